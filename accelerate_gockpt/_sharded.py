"""Accelerate with FSDP2 (``fully_shard``): every process saves its own shards (issue 13).

Under FSDP2 the model's parameters and the optimizer state are ``DTensor`` shards. Stock
``save_state`` writes them through ``torch.distributed.checkpoint`` (``SHARDED_STATE_DICT``,
FSDP2's default) or gathers them on the main process (``FULL_STATE_DICT``), and blocks for
either. Attached, every process runs a :class:`gockpt.sharded.ShardedEngine` over its local
shards instead: it copies (and in the multi-step modes replays) only its shards, and the parts
are committed together (two-phase, :mod:`gockpt.sharded`), so a checkpoint folder is a sharded
GoCkpt checkpoint::

    checkpoints/checkpoint_<n>/
        manifest.json, sharded.json              written last, by the main process's commit
        rank-<r>/, rank-<r>.sharding.json        process r's part

Accelerate's other files of ``save_state`` (schedulers, sampler and dataloader state, the
scaler, registered objects, ``Accelerator.step``: :mod:`._host_state`, Accelerate's own
functions, at the captured step) are kept in the main process's part, and each process's
``random_states_<r>.pkl`` in its own part. ``total_limit`` is applied after the commit.

Loading (:func:`load`, from the checkpointer's ``load_state``, any number of processes):
:func:`gockpt.dcp.load_sharded` puts the model and optimizer shards in place through
``torch.distributed.checkpoint`` (resharding as needed); the other files are laid out in a
temporary folder and loaded by Accelerate's own ``load_accelerator_state`` and
``load_custom_state``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

import gockpt
from gockpt.sharded import INDEX_FILE, ShardedEngine, ShardedHandle
from gockpt.storage import prune_numbered

from . import _host_state

log = logging.getLogger("accelerate_gockpt")

PART_FORMAT = "gockpt-accelerate-sharded"
"""``format`` of the state kept in each part: ``{"format", "iteration", "files": {name: bytes}}``."""


def holds_shards(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ``DTensor`` shards (``fully_shard``, FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def is_sharded_checkpoint(path: str) -> bool:
    """Whether the folder ``path`` is a sharded GoCkpt checkpoint (written under FSDP2)."""
    return os.path.isfile(os.path.join(path, INDEX_FILE))


class ShardedSaves:
    """The checkpoints of one accelerator under FSDP2: a :class:`ShardedEngine` on every process.

    Args:
        accelerator: the ``Accelerator`` (``torch.distributed`` initialized).
        model: the prepared (``fully_shard``-ed) model; one model per accelerator.
        optimizers: its inner ``torch.optim`` optimizers.
        config: engine options.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, accelerator: Any, model: nn.Module, optimizers: Sequence[Optimizer],
                 config: gockpt.GoCkptConfig) -> None:
        self.accelerator = accelerator
        self.sharded = ShardedEngine(model, list(optimizers), config)
        self.metrics: list[gockpt.CheckpointMetrics] = []
        self._handles: list[ShardedHandle] = []
        self._finished: list[gockpt.CheckpointMetrics] = []
        self._taken = 0
        self._warned_hooks = False

    @property
    def engine(self) -> gockpt.Engine:
        return self.sharded.engine

    @property
    def saves(self) -> list[ShardedHandle]:
        """Handles of the requests not yet finished (or not yet seen finished), oldest first."""
        return list(self._handles)

    def save(self, final: str, *, iteration: int, exact_step: bool, rotate_root: str | None,
             total_limit: int | None) -> ShardedHandle:
        """Request the sharded checkpoint folder ``final``; collective (every process, same step).

        Raises:
            ValueError: ``final`` exists or is being written (automatic naming, as Accelerate).
            RuntimeError, OSError: as :meth:`gockpt.sharded.ShardedEngine.save`.
        """
        from accelerate.utils import broadcast_object_list

        acc = self.accelerator
        taken = rotate_root is not None and acc.is_main_process and (os.path.exists(final) or any(
            h.path == final and not h.done() for h in self._handles))
        if acc.num_processes > 1:  # the main process decides: every process raises, or none
            taken = broadcast_object_list([taken])[0]
        if taken:
            raise ValueError(
                f"Checkpoint directory {final} ({acc.save_iteration}) already exists. Please "
                "manually override `self.save_iteration` with what iteration to start with.")
        if acc._save_model_state_pre_hook and not self._warned_hooks:
            self._warned_hooks = True
            log.warning("gockpt: save_state pre-hooks are not run for FSDP2 checkpoints (the weights "
                        "are saved from every process's shards, not handed to the hooks)")

        def part_state(_part: Any) -> dict[str, Any]:
            # At the captured step, on every process: Accelerate's files describe that step.
            files = _host_state.host_files(acc, rng_only=not acc.is_main_process)
            return {"format": PART_FORMAT, "iteration": iteration, "files": files}

        handle = self.sharded.save(final, part_state_fn=part_state, max_overlap_steps=1 if exact_step else None)
        if acc.is_main_process and rotate_root is not None and total_limit is not None:
            handle.add_done_callback(lambda h: _rotate(h, rotate_root, total_limit))
        self._handles.append(handle)
        self._harvest()
        return handle

    @property
    def capture_pending(self) -> bool:
        """Whether a save of this process is still to take its state (not yet captured)."""
        return any(h.captured_step is None and not h.done() for h in self._handles)

    def boundary(self) -> None:
        """A step boundary no hook sees (the start of an accumulation context)."""
        self.sharded.step_end()

    def wait(self, timeout_s: float | None = None) -> list[gockpt.CheckpointMetrics]:
        """Finish every pending checkpoint on every process; collective.

        Returns:
            Metrics of the checkpoints finished since the last wait (committed ones on the
            main process).
        """
        self.sharded.wait(timeout_s)
        self._harvest()
        out, self._finished = self._finished, []
        return out

    def take_published(self) -> list[gockpt.CheckpointMetrics]:
        """Metrics of checkpoints committed since the last call (training thread)."""
        self._harvest()
        new, self._taken = self.metrics[self._taken:], len(self.metrics)
        return new

    def close(self, *, collective: bool = True) -> None:
        """Finish the pending checkpoints and stop the engine; collective unless told the
        processes no longer meet (:meth:`gockpt.sharded.ShardedEngine.close`)."""
        try:
            self.sharded.close(collective=collective)
        finally:
            self._harvest()

    def _harvest(self) -> None:
        for h in [h for h in self._handles if h.done()]:
            self._handles.remove(h)
            try:
                m = h.outcome(0)
            except BaseException:  # noqa: BLE001 - raised on the training thread by wait()
                continue
            self._finished.append(m)
            if not m.skipped:
                self.metrics.append(m)


def _rotate(handle: ShardedHandle, root: str, total_limit: int) -> None:
    # Main process, commit thread: only after this checkpoint is in place (PCcheck §4.1).
    try:
        m = handle.result(0)
    except BaseException:  # noqa: BLE001 - the training thread raises it
        return
    if m.skipped:
        return
    try:
        prune_numbered(root, total_limit)
    except OSError:
        log.warning("gockpt: could not delete old checkpoints in %s", root, exc_info=True)


def load(accelerator: Any, path: str, model: nn.Module, optimizers: Sequence[Optimizer], *,
         verify: bool = True) -> int:
    """Load the sharded checkpoint folder ``path`` into the accelerator's objects; collective.

    Model and optimizer shards through :func:`gockpt.dcp.load_sharded` (any number of
    processes); schedulers, dataloaders, scaler, RNG and ``Accelerator.step`` through
    Accelerate's ``load_accelerator_state``, registered objects through ``load_custom_state``
    (RNG states are restored where the number of processes is the one saved).

    Returns:
        The ``ProjectConfiguration.iteration`` the checkpoint was saved at.

    Raises:
        gockpt.CheckpointCorruptError: a part whose state was not written by this module, or a
            file that does not match its checksum.
        FileNotFoundError: no complete checkpoint at ``path``.
    """
    from accelerate.checkpointing import load_accelerator_state, load_custom_state
    from accelerate.utils import broadcast_object_list

    from gockpt.dcp import load_sharded

    for hook in accelerator._load_model_state_pre_hook.values():
        hook([], path)  # as stock under FSDP: the sharded models are not handed to the hooks
    # This process's part when the number of processes is the one saved, else the main one's.
    own = load_sharded(path, model, list(optimizers), verify=verify)
    if not isinstance(own, dict) or own.get("format") != PART_FORMAT:
        raise gockpt.CheckpointCorruptError(f"{path}: a sharded checkpoint not written by accelerate_gockpt",
                                            path=path)
    main = own if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        main = broadcast_object_list([main])[0]
    assert main is not None
    map_location = "cpu"
    if accelerator.num_processes > 1 and accelerator.multi_device:
        map_location = "on_device"
    with tempfile.TemporaryDirectory(prefix="gockpt-accelerate-") as d:
        for name, data in {**main["files"], **own["files"]}.items():
            if os.path.basename(name) != name:
                raise gockpt.CheckpointCorruptError(f"{path}: a file name that is not a plain name: {name!r}",
                                                    path=path)
            Path(d, name).write_bytes(data)
        override = load_accelerator_state(d, [], [], accelerator._schedulers, accelerator._dataloaders,
                                          accelerator.process_index, accelerator.scaler, map_location)
        for i, obj in enumerate(accelerator._custom_objects):
            load_custom_state(obj, d, i)
    if "step" in override:
        accelerator.step = override["step"]
    return int(main["iteration"])
