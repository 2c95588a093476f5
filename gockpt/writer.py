"""The writer seam: how one save's snapshot becomes files (a public interface).

``Engine.save(path, writer=...)`` hands every save to a :class:`CheckpointWriter`. The default
(no writer) is GoCkpt's own layout: the tracked tensors in safetensors shards, the rest in one
pickled file, ``manifest.json`` last. A writer can instead name the tensor files and the tensors
in them (written zero-copy from the host snapshot, gathered in file order), add whole files
built on the persist thread from the snapshot, stage in a directory known at request time (so
other processes can add their files), and run code right before and after the publish.
``manifest.json`` stays the completion marker whatever the writer. DCP's ``StorageWriter`` and
Hugging Face's storage writer are the precedent; the Accelerate adapter's writer
(``accelerate_gockpt``) produces Accelerate's own folder layout this way, written once.

Call sequence of one save with a writer (persist thread unless noted):

1. (training thread, at the request) ``tensor_files(layout)``: which files hold which tracked
   tensors, under which names; None keeps GoCkpt's shards.
2. ``files(snapshot)``: more files, from the snapshot at the captured step.
3. every file written; ``before_publish(snapshot)``; the manifest; the publish (atomic).
4. ``after_publish(snapshot)`` once published (its errors are logged, the save stands).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .format import ShardLayout, TensorSpec, encode_header
from .handle import CheckpointMetrics
from .layout import StateLayout
from .snapshot import SlotLayout

__all__ = ["CheckpointWriter", "Snapshot", "TensorFile"]


@dataclass
class TensorFile:
    """One safetensors file a writer asks for.

    Attributes:
        name: file name in the checkpoint directory (e.g. ``"model.safetensors"``).
        tensors: ``(layout entry key, stored name)`` pairs in file order; entry keys are
            :class:`gockpt.layout.StateLayout` keys (``layout.entries[i].key``).
        metadata: the safetensors ``__metadata__`` (str -> str).
    """

    name: str
    tensors: list[tuple[str, str]]
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Snapshot:
    """What a writer sees on the persist thread: one save at its captured step, on the host.

    The tensors are views of the save's host buffer: valid until the writer's call returns;
    clone what must outlive it, and never modify them.

    Attributes:
        path: the checkpoint's path (local path or fsspec URL).
        model_state_dict: the model's ``state_dict()`` (CPU tensors).
        optimizer_state_dicts: each optimizer's ``state_dict()`` (CPU tensors).
        extra: what ``state_fn`` returned at the captured step (tensors on the CPU).
        metrics: the save's metrics so far (``requested_step``, ``captured_step``, ``mode``,
            ``num_overlap_steps``).
        staging: the local directory being written (None on object stores).
    """

    path: str
    model_state_dict: dict[str, Any]
    optimizer_state_dicts: list[dict[str, Any]]
    extra: Any
    metrics: CheckpointMetrics
    staging: str | None = None


class CheckpointWriter:
    """How one save becomes files. Subclass and override what differs from GoCkpt's layout.

    Attributes:
        staging: an existing, empty local directory beside the checkpoint, named
            ``.<anything>.gockpt-tmp-<pid>-<hex>``, to write into (the caller makes it at
            request time, e.g. so other processes can add their files); None: the storage
            target makes one.
        claim_directory: the engine claims the checkpoint's parent directory for this process
            (one writer per directory, see :func:`gockpt.storage.claim_directory`); False for a
            parent other jobs may share (a user's folder of unrelated outputs).
        reads_tensors_at_publish: :meth:`before_publish` or :meth:`after_publish` read the
            snapshot's tensors (views of the engine's host slot), so the slot is held until
            the save ends. False lets the next save reuse the slot as soon as every file's
            bytes are written, before the fsyncs, the manifest and the publish.
        framework_names: the names (matched whole) of the entries a checkpoint in this layout
            holds when its framework wrote it without GoCkpt (no ``manifest.json``): a local
            directory holding only such entries is replaced like a checkpoint, as the
            framework's own save would write over them. None: only GoCkpt checkpoints, empty
            directories, files and symlinks are replaced; a save to any other directory raises
            ``FileExistsError`` (:func:`gockpt.fsutil.check_replaceable`).
    """

    staging: str | None = None
    claim_directory: bool = True
    reads_tensors_at_publish: bool = True
    framework_names: re.Pattern[str] | None = None

    def tensor_files(self, layout: StateLayout) -> list[TensorFile] | None:
        """The tensor files of this save; None: GoCkpt's shards of every tracked tensor.

        Tracked tensors left out of every file are still snapshotted and replayed, and reach
        :meth:`files` through the :class:`Snapshot`. Called on the training thread at the
        request.

        Raises:
            Anything: the request fails with it (nothing is written).
        """
        return None

    def files(self, snapshot: Snapshot) -> Mapping[str, bytes]:
        """More files to write, listed in the manifest. Persist thread.

        Returns:
            name -> the file's bytes: ``bytes`` or a 1-D ``uint8`` ``memoryview`` (e.g. what
            :func:`gockpt.torchfile.torch_file` builds without holding the GIL for the bytes).
        """
        return {}

    def before_publish(self, snapshot: Snapshot) -> None:
        """Called once every file is written, before the manifest; may raise to fail the save."""

    def after_publish(self, snapshot: Snapshot) -> None:
        """Called once the checkpoint is published (e.g. retention); errors are logged only."""


def plan_tensor_files(
    files: list[TensorFile], layout: StateLayout, slot: SlotLayout
) -> tuple[list[ShardLayout], list[list[tuple[int, int]]]]:
    """Shard layouts of a writer's tensor files and the slot byte ranges of their data.

    Returns:
        (shards, segments): ``segments[i]`` lists the ``[begin, end)`` byte ranges of the host
        slot that make file ``i``'s data section, in file order (see ``PersistRequest``).

    Raises:
        KeyError: an entry key that is not in ``layout``.
        ValueError: a stored name used twice in one file.
    """
    specs = {e.key: e.spec for e in layout.entries}
    shards, segments = [], []
    for f in files:
        entries, spans, offset = [], [], 0
        names = [stored for _, stored in f.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{f.name}: a tensor name is used twice")
        for key, stored in f.tensors:
            spec = specs[key]
            entries.append((TensorSpec(stored, spec.dtype, spec.shape), (offset, offset + spec.nbytes)))
            begin = slot.offsets[key]
            spans.append((begin, begin + spec.nbytes))
            offset += spec.nbytes
        header = encode_header(entries, dict(f.metadata))
        shards.append(ShardLayout(f.name, header, {s.key: span for s, span in entries}, offset))
        segments.append(spans)
    return shards, segments
