"""``GoCkptCallback``: the training hooks a CheckpointIO does not get, wired to the engine."""

from __future__ import annotations

import copy
import logging
import queue
from dataclasses import replace
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import gockpt
from gockpt import MODES, Engine, SaveHandle
from gockpt.storage import cleanup_staging

from .io import GoCkptIO, make_placeholder, remove_placeholder, tidy_placeholders

log = logging.getLogger("lightning_gockpt")

# Strategies that write sharded checkpoints themselves and never call CheckpointIO.
_UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")
# Entries of Lightning's dict whose tensors the engine copies from the live model and optimizers.
_ENGINE_KEYS = ("state_dict", "optimizer_states")


class GoCkptCallback(Callback):
    """Drives the :class:`gockpt.Engine` of a :class:`~lightning_gockpt.GoCkptIO` from Lightning's hooks.

    Added to every Trainer by the ``lightning.pytorch.callbacks_factory`` entry point; inert
    unless ``trainer.strategy.checkpoint_io`` is a ``GoCkptIO``. Passing one in ``callbacks``
    works too (the explicit one links, the factory's stays inert). Only global rank 0 runs an
    engine, since Lightning's CheckpointIO saves there.

    Call sequence (training thread, rank 0):

    1. ``setup``: link to the ``GoCkptIO``; refuse strategies that bypass CheckpointIO.
    2. ``on_train_start``: build the engine over ``trainer.lightning_module`` and the raw torch
       optimizers, with ``explicit_before_update`` (Lightning runs forward and backward inside
       ``optimizer.step(closure)``, so the step pre-hook fires before the forward).
    3. ``on_before_optimizer_step``: ``engine.before_update()``, the end of a copy window.
    4. ``on_train_batch_end``: ``engine.step_end()``, then log finished checkpoints. This callback
       runs before ``ModelCheckpoint`` (Lightning puts checkpoint callbacks last).
    5. ``on_train_end``: ``engine.wait()`` while model and optimizers are still on their device;
       later requests (``ModelCheckpoint.on_train_end``) snapshot at once (mode ``async``).
    6. ``on_exception``, ``teardown``, ``GoCkptIO.teardown``: wait and close (backstops).
    """

    def __init__(self, *, _from_factory: bool = False) -> None:
        self._from_factory = _from_factory
        self.io: GoCkptIO | None = None
        self.engine: Engine | None = None
        self._trainer: Trainer | None = None
        self._finished: queue.SimpleQueue[tuple[SaveHandle, int]] = queue.SimpleQueue()
        self._pending: list[SaveHandle] = []
        self._deferred: list[tuple[str, list[SaveHandle]]] = []  # removals waiting for newer saves
        self._num_batches = 0
        self._ended = False
        self._failed = False

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(getattr(io, "checkpoint_io", None), GoCkptIO):
            raise ValueError("GoCkptIO already saves in the background; do not wrap it in AsyncCheckpointIO")
        if not isinstance(io, GoCkptIO) or _linking_callback(trainer) is not self:
            return
        names = [c.__name__ for c in type(trainer.strategy).__mro__]
        unsupported = next((n for n in names if n in _UNSUPPORTED_STRATEGIES), None)
        if unsupported is not None:
            raise ValueError(
                f"GoCkptIO does not support {type(trainer.strategy).__name__} ({unsupported}): it "
                "writes sharded checkpoints itself and bypasses CheckpointIO. Use one device or "
                "strategy='ddp'; FSDP and DeepSpeed support is planned.")
        self.io, self._trainer = io, trainer
        io._callback = self

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ended = self._failed = False
        if self.io is None or not trainer.is_global_zero:
            return
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                cleanup_staging(str(cb.dirpath), self.io.config.storage_options)
                tidy_placeholders(str(cb.dirpath), self.io.config.storage_options)
        if self.engine is None:
            self.engine = self._build(trainer, self.io.config)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.engine is not None:
            self.engine.before_update()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._num_batches += 1
        if self.engine is not None:
            self.engine.step_end()
            self._log_finished()
            self._remove_deferred()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ended = True
        if self.engine is not None:
            self.engine.wait()
            self._log_finished()
            self._remove_deferred()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._ended = self._failed = True
        if self.engine is not None:
            try:
                self.engine.wait()
            except Exception:  # the run's own exception is the one to raise
                log.exception("gockpt: finishing checkpoints after %r failed", exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.close()

    # ------------------------------------------------------------------ used by GoCkptIO

    def is_monitored(self, path: str) -> bool:
        """Whether ``path`` is being saved as a ModelCheckpoint's metric-ranked (top-k) checkpoint."""
        return self._trainer is not None and any(
            isinstance(cb, ModelCheckpoint) and cb.monitor is not None and path in cb.best_k_models
            for cb in self._trainer.checkpoint_callbacks)

    def request(self, checkpoint: dict[str, Any], path: str, *, exact_step: bool) -> SaveHandle:
        """Request a checkpoint of Lightning's ``checkpoint`` dict at ``path`` (training thread)."""
        trainer = self._trainer
        assert self.io is not None and trainer is not None
        weights_only = "optimizer_states" not in checkpoint
        taken = _without_engine_keys(checkpoint, deep_copy=True)
        at_batch = self._num_batches

        def state_fn() -> dict[str, Any]:
            # The engine calls this at the captured step. Later than the request, Lightning's
            # dict is taken again so loops, schedulers and callbacks match the tensors.
            lightning = taken
            if self._num_batches != at_batch:
                dumped = trainer._checkpoint_connector.dump_checkpoint(weights_only)
                lightning = _without_engine_keys(dumped, deep_copy=False)  # the engine serializes it now
            return {"lightning": lightning, "optimizer_states": not weights_only}

        self._deferred = [(p, hs) for p, hs in self._deferred if p != path]  # replaced, not removed
        make_placeholder(path, self.io.config.storage_options)
        if self.engine is None:  # outside fit (e.g. Trainer.save_checkpoint afterwards): blocking save
            with self._build(trainer, replace(self.io.config, mode="sync")) as engine:
                return engine.save(path, state_fn=state_fn)
        handle = self.engine.save(path, state_fn=state_fn, exact_step=exact_step,
                                  mode="async" if self._ended else None)
        if handle.skipped:  # when_full="skip": no checkpoint, so no placeholder either
            remove_placeholder(path, self.io.config.storage_options)
        step = trainer.global_step
        handle.add_done_callback(lambda h: self._finished.put((h, step)))
        self._pending = [h for h in self._pending if not h.done()] + [handle]
        return handle

    def remove(self, path: str) -> None:
        """Remove the checkpoint at ``path`` (training thread).

        An in-flight save of ``path`` is cancelled at once. A complete checkpoint is kept until
        the saves requested before its removal are durable, so that a crash in between still
        finds a complete checkpoint (``ModelCheckpoint(save_top_k=1)`` removes the previous one
        right after requesting the next).
        """
        assert self.io is not None
        if self.engine is None:
            gockpt.remove_checkpoint(path, self.io.config.storage_options)
            return
        newer = [h for h in self._pending if not h.done()]
        if newer and all(h.path != path for h in newer):
            self._deferred.append((path, newer))
        else:
            self.engine.remove(path)

    def close(self) -> None:
        """Finish pending checkpoints and stop the engine; re-raises a background error."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            engine.close()
        except Exception:
            if self._failed:  # the run's own exception is the one to raise
                log.exception("gockpt: a checkpoint failed while the run was stopping")
            else:
                self._failed = True
                raise
        finally:
            self._log_finished()
            if self._failed:  # a newer save may be missing: keep what was to be removed
                self._deferred = []
            self._remove_deferred()

    def _remove_deferred(self) -> None:
        assert self.io is not None
        keep, ready = [], []
        for path, newer in self._deferred:
            if not all(h.done() for h in newer):
                keep.append((path, newer))
            elif any(_durable(h) for h in newer):
                ready.append(path)
            else:  # the newer saves were cancelled or failed: wait for the ones after them
                later = [h for h in self._pending if not h.done()]
                if later:
                    keep.append((path, later))
                else:
                    ready.append(path)
        self._deferred = keep
        for path in ready:
            if self.engine is not None:
                self.engine.remove(path)
            else:
                gockpt.remove_checkpoint(path, self.io.config.storage_options)

    # ------------------------------------------------------------------ helpers

    def _build(self, trainer: Trainer, config: gockpt.GoCkptConfig) -> Engine:
        # Steps in manifests and in the `latest` pointer are Lightning's global steps, so the
        # checkpoints of a resumed run rank above the ones it resumed from. Before any optimizer
        # holds state the engine counts from 0, as it must to plan multi-step copies safely.
        restored = trainer.global_step and all(opt.state for opt in trainer.optimizers)
        return Engine(trainer.lightning_module, list(trainer.optimizers), config,
                      explicit_before_update=True, start_step=trainer.global_step if restored else None)

    def _log_finished(self) -> None:
        trainer = self._trainer
        while True:
            try:
                handle, step = self._finished.get_nowait()
            except queue.Empty:
                return
            if handle.skipped or trainer is None:
                continue
            try:
                m = handle.result(0)
            except Exception:  # cancelled by removal; a failure is raised by the engine's next hook
                continue
            metrics = {
                "gockpt/stall_s": m.stall_s,
                "gockpt/bytes": float(m.persist_bytes),
                "gockpt/gbps": m.persist_gbps,
                "gockpt/time_to_durable_s": m.time_to_durable_s,
                "gockpt/num_overlap_steps": float(m.num_overlap_steps),
                "gockpt/mode": float(MODES.index(m.mode)),
                "gockpt/captured_step": float(m.captured_step or 0),
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)


def _durable(handle: SaveHandle) -> bool:
    try:
        handle.result(0)
    except Exception:  # cancelled or failed
        return False
    return not handle.skipped


def _linking_callback(trainer: Trainer) -> GoCkptCallback:
    ours = [cb for cb in trainer.callbacks if isinstance(cb, GoCkptCallback)]  # type: ignore[attr-defined]
    explicit = [cb for cb in ours if not cb._from_factory]
    return (explicit or ours)[0]


def _without_engine_keys(checkpoint: dict[str, Any], *, deep_copy: bool) -> dict[str, Any]:
    out = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
    return copy.deepcopy(out) if deep_copy else out
