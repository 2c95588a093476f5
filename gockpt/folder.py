"""Checkpoints in a framework's own folder layout, written once by the engine: the generic part.

A framework's checkpoint can be a folder of its own files (Accelerate's ``save_state``:
``model.safetensors``, ``optimizer.bin``, ...), often numbered (``checkpoints/checkpoint_<n>``)
and rotated (keep the newest N). A writer for it (:class:`gockpt.writer.CheckpointWriter`)
names those files; what no framework owns is here. Call sequence of one save:

1. (training thread, at the request, writing process) :meth:`StagingFolders.make` makes a
   staging folder beside the checkpoint folder (``.0-<name>.gockpt-tmp-<pid>-<hex>``: loaders
   that order folders by the first run of digits in a name, as Accelerate's does, sort a
   leftover of a killed process with ``0``, before every checkpoint but ``checkpoint_0``, which
   it ties with), cleaning what dead processes left in that parent once (the plugin's own
   loader skips it); the other processes learn the folder (:mod:`gockpt.replicated`).
2. (engine's io threads) the model's tensors are written zero-copy from the host snapshot,
   each tied weight once (:func:`stored_once`).
3. (persist thread) the framework's other files, and the sidecar ``gockpt.json``
   (:meth:`FolderWriter.sidecar_file`: the captured step of the save, which the framework's
   loader ignores); the other processes' files are awaited (:meth:`FolderWriter.before_publish`).
4. (persist thread) the manifest, the atomic rename into place (PCcheck §4.1: the old
   checkpoint is never touched before the new one is complete), then the numbered checkpoints
   past ``total_limit`` are deleted, each crash-safely (:meth:`FolderWriter.after_publish`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointCorruptError
from .fsutil import scratch_path
from .layout import StateLayout
from .ranks import wait_for_shares
from .storage import checkpoint_number, cleanup_staging, has_manifest, numbered_checkpoints, prune_numbered
from .writer import CheckpointWriter, Snapshot

__all__ = ["SIDECAR_NAME", "FolderWriter", "StagingFolders", "folder_number", "latest_numbered",
           "read_sidecar", "stored_once"]

SIDECAR_NAME = "gockpt.json"
"""Beside the framework's files: ``format``, ``version``, the writer's own fields (e.g.
``iteration``), and ``requested_step``, ``captured_step`` (optimizer updates the engine
counted), ``mode`` and ``num_overlap_steps`` of the save."""


@dataclass(kw_only=True)
class FolderWriter(CheckpointWriter):
    """The framework-free part of a writer of a framework's folder layout (see the module doc).

    Subclass it with the framework's files (``tensor_files``, ``files``; put
    :meth:`sidecar_file` among them); this class waits for the other processes' files before
    the publish and rotates numbered checkpoints after it.

    Attributes:
        staging: the staging folder made at the request (:meth:`StagingFolders.make`).
        sidecar_format, sidecar_version: the sidecar's ``format`` and ``version`` fields.
        sidecar_fields: more sidecar fields of this save (JSON values, e.g. ``iteration``).
        shares: file names the other processes add to ``staging`` (e.g. one per rank).
        timeout_s: how long to wait for them, in seconds.
        stopped: True => stop waiting for them (the caller is closing).
        rotate_root, total_limit: where the numbered checkpoints are and how many to keep
            after the publish (None: keep all).
        claim_directory: claim the parent folder (True for a run's own ``checkpoints/``; not
            the folder around an explicit output folder, which other jobs may share).
        reads_tensors_at_publish: False: waiting for the shares and rotating read no tensor,
            so the host slot goes to the next save once the files are written.
    """

    staging: str
    sidecar_format: str
    sidecar_version: int = 1
    sidecar_fields: dict[str, Any] = field(default_factory=dict)
    shares: list[str] = field(default_factory=list)
    timeout_s: float = 600.0
    stopped: Callable[[], bool] = lambda: False
    rotate_root: str | None = None
    total_limit: int | None = None
    claim_directory: bool = True
    reads_tensors_at_publish: bool = False

    def sidecar_file(self, snapshot: Snapshot) -> bytes:
        """The sidecar's bytes (:data:`SIDECAR_NAME`) for the save at ``snapshot``."""
        m = snapshot.metrics
        return json.dumps({
            "format": self.sidecar_format, "version": self.sidecar_version, **self.sidecar_fields,
            "requested_step": m.requested_step, "captured_step": m.captured_step, "mode": m.mode,
            "num_overlap_steps": m.num_overlap_steps,
        }, indent=1).encode()

    def before_publish(self, snapshot: Snapshot) -> None:
        """Wait for :attr:`shares` in the staging folder.

        Raises:
            TimeoutError: one is missing after :attr:`timeout_s` seconds or once ``stopped()``.
        """
        wait_for_shares(self.staging, self.shares, self.timeout_s, self.stopped)

    def after_publish(self, snapshot: Snapshot) -> None:
        """Delete the oldest numbered checkpoints in :attr:`rotate_root` past :attr:`total_limit`."""
        if self.rotate_root is not None and self.total_limit is not None:
            prune_numbered(self.rotate_root, self.total_limit)


def stored_once(layout: StateLayout, key_map: Mapping[str, tuple[int, str]],
                num_files: int) -> list[list[tuple[str, str]]]:
    """Per file, the ``(layout entry key, stored name)`` pairs of the model's tensors.

    A tied weight is one entry under several model keys: it is stored once, under the first
    of its names in ``state_dict`` order, as safetensors' ``save_model`` and Accelerate keep it
    (their loaders tie it again).

    Args:
        layout: the save's layout (``model_keys``, ``aliases``).
        key_map: engine model key -> (file index, stored name) (:func:`gockpt.wrapped.engine_model`).
        num_files: files (one per model).

    Returns:
        ``num_files`` lists, in ``state_dict`` order, for :class:`gockpt.writer.TensorFile`.

    Raises:
        KeyError: a model key missing from ``key_map``.
    """
    first: dict[str, str] = {}  # stored entry key -> the first model key naming it
    for key in layout.model_keys:
        entry = f"model.{key}"
        first.setdefault(layout.aliases.get(entry, entry), key)
    per_file: list[list[tuple[str, str]]] = [[] for _ in range(num_files)]
    for entry, key in first.items():
        index, name = key_map[key]
        per_file[index].append((entry, name))
    return per_file


class StagingFolders:
    """Staging folders beside checkpoint folders, made at the request (step 1 of the module doc)."""

    def __init__(self) -> None:
        self._cleaned: set[str] = set()

    def make(self, final: str) -> str:
        """Make and return an empty staging folder for the checkpoint folder ``final``.

        Its parent is created if missing; the first time a parent is seen, the staging left
        there by processes that died mid-save is removed
        (:func:`gockpt.storage.cleanup_staging`).

        Raises:
            OSError: a folder could not be made.
        """
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        if parent not in self._cleaned:
            cleanup_staging(parent)
            self._cleaned.add(parent)
        # "0-": a loader ordering by the first digits in a name sorts a leftover with 0 (first,
        # or tied with checkpoint_0).
        staging = scratch_path(parent, f"0-{os.path.basename(final)}")
        os.mkdir(staging)
        return staging


def read_sidecar(directory: str, sidecar_format: str) -> dict[str, Any] | None:
    """The sidecar of a checkpoint folder, or None if it has none of ``sidecar_format``
    (e.g. a folder the framework wrote itself)."""
    try:
        with open(os.path.join(directory, SIDECAR_NAME), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) and data.get("format") == sidecar_format else None


def latest_numbered(root: str) -> str:
    """The highest-numbered checkpoint folder in local ``root`` (every one there is complete).

    Raises:
        FileNotFoundError: there is none (names ``root``).
    """
    names = numbered_checkpoints(root)
    if not names:
        raise FileNotFoundError(f"no checkpoint in {root}")
    return os.path.join(root, names[-1])


def folder_number(directory: str, sidecar_format: str, key: str, *,
                  from_name: bool) -> int | None:
    """The number of a checkpoint folder: its sidecar's ``key``, else (with ``from_name``) the
    first run of digits in its name (:func:`gockpt.storage.checkpoint_number`); None if neither.

    Raises:
        KeyError, ValueError: a sidecar of ``sidecar_format`` without an integer ``key``.
    """
    sidecar = read_sidecar(directory, sidecar_format)
    if sidecar is not None:
        return int(sidecar[key])
    if from_name:
        return checkpoint_number(os.path.basename(os.path.normpath(directory)))
    return None


def check_before_load(directory: str, *, verify: bool = True) -> None:
    """Before a framework's own loader reads the local checkpoint folder ``directory``: refuse
    what would load silently wrong or never return.

    A folder the engine wrote (it holds GoCkpt's ``manifest.json``) is checked against its
    manifest first: every listed file present, regular (not a symlink) and of its size, for
    shards the safetensors header, and with ``verify`` its xxh3-64 checksum
    (:func:`gockpt.audit.verify_checkpoint`). The framework's loader checks none of that: a
    flipped bit in ``model.safetensors`` would load as a wrong weight. In any folder (one the
    framework wrote itself too), an entry that is a FIFO, device or socket, or a symlink to
    one, is refused: a loader opening it blocks forever.

    Raises:
        FileNotFoundError: no such folder.
        CheckpointCorruptError: naming the file and what is wrong.
    """
    from .audit import require_intact  # audit imports the loaders; not needed to write

    with os.scandir(directory) as it:
        for entry in it:
            try:
                mode = os.stat(entry.path).st_mode  # through a symlink: what a loader opens
            except FileNotFoundError:
                continue  # a dangling symlink: the loader reports the file it misses
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointCorruptError(
                    f"{entry.path}: not a regular file or folder (a FIFO, device or socket)",
                    path=directory)
    if has_manifest(directory):
        require_intact(directory, checksums=verify)
