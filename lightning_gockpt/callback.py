"""``GoCkptCallback``: the training hooks a CheckpointIO does not get, wired to the engine."""

from __future__ import annotations

import copy
import logging
import threading
import warnings
import weakref
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import (
    Callback,
    Checkpoint,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    ThroughputMonitor,
)
from torch import nn, optim

import gockpt
from gockpt import Engine, SaveHandle, _exit
from gockpt.layout import shared_parameters
from gockpt.plan import MULTI_STEP_MODES
from gockpt.fsutil import path_key
from gockpt.sharded import ReplicasDifferError, ShardedHandle
from gockpt.storage import cleanup_staging

from . import _registry, deepspeed, fsdp, sharded
from .io import GoCkptIO, make_placeholder, remove_placeholder, tidy_placeholders
from .staged import StagedAdapterEngine, StagedHandle, drain_discards, remove_now

log = logging.getLogger("lightning_gockpt")

# Lightning's callbacks whose on_train_epoch_start changes no tensor of the model or optimizers.
_SHOW_AT_EPOCH_START = (ProgressBar, LearningRateMonitor, GradientAccumulationScheduler)
# ... and whose on_train_batch_start changes none.
_SHOW_AT_BATCH = (ProgressBar, LearningRateMonitor, ThroughputMonitor)

# One writer | an engine on every rank (sharded, DDP shares) | DeepSpeed's files.
_Handle = SaveHandle | ShardedHandle | StagedHandle


class GoCkptCallback(Callback):
    """Drives the :class:`gockpt.Engine` of a :class:`~lightning_gockpt.GoCkptIO` from Lightning's hooks.

    Added by the ``lightning.pytorch.callbacks_factory`` entry point to every Trainer whose
    plugins hold a ``GoCkptIO`` (other Trainers get nothing); passing one in ``callbacks``
    works too. Under one device the process runs a :class:`gockpt.Engine`. Under
    ``ModelParallelStrategy`` every rank runs a sharded engine, and under DDP with more than one
    process every rank runs a replicated one, each storing its share of the state
    (:mod:`lightning_gockpt.sharded`, :mod:`lightning_gockpt.replicated`); the strategy's
    checkpoint hooks are installed in ``setup``. (DDP with a ZeRO optimizer, whose state is not
    replicated, or with checkpoints on an object store keeps Lightning's path: global rank 0
    runs the engine; :func:`lightning_gockpt.sharded.shares_write`.)
    In ``setup`` it moves itself to the front of ``trainer.callbacks``, so that its hooks run
    before any other callback's; ``teardown`` gives the list back in the order it found it.

    Call sequence (training thread, rank 0):

    1. ``setup``: link to the ``GoCkptIO``; route ``ModelParallelStrategy``'s and DDP's
       checkpoints through GoCkpt on every rank, and ``FSDPStrategy``'s (``state_dict_type=
       "full"``) through rank 0's engine, which persists the gathered dict (it tracks no live
       state: the strategy's gather is the copy), and ``DeepSpeedStrategy``'s through an engine
       on every rank that takes DeepSpeed's files (:mod:`lightning_gockpt.deepspeed`), and
       ``FSDPStrategy(state_dict_type="sharded")``'s through one that writes stock's DCP
       directory with ``async_save`` (:mod:`lightning_gockpt.fsdp`).
    2. ``on_train_start``: build the engine over ``trainer.lightning_module`` and the raw torch
       optimizers, with ``explicit_before_update`` (Lightning runs forward and backward inside
       ``optimizer.step(closure)``, so the step pre-hook fires before the forward). It runs
       before other callbacks' ``on_train_start`` (a ``Timer`` does not count its start-up).
    3. ``on_before_optimizer_step``: ``engine.before_update()``, the end of a copy window.
       An optimizer step pre-hook finishes the saves in flight (``engine.flush()``) when an
       update comes while ``trainer.callbacks`` does not hold this callback (the tuner's
       learning-rate and batch-size finders swap the list out while they train).
    4. ``on_train_batch_end``, by a companion callback placed right before the checkpoint
       callbacks (where ``ModelCheckpoint`` saves): ``engine.step_end()`` (the step boundary where
       checkpoints take Lightning's dict), then log finished checkpoints.
    5. ``on_train_epoch_end``, ``on_validation_start`` and, where another callback or the
       module defines it, ``on_train_epoch_start``: ``engine.flush()``, so that no copy is
       pending while other callbacks may change weights outside ``optimizer.step()`` (weight
       averaging swaps weights in through ``.data``, which no version counter sees).
    6. ``on_train_end``: ``engine.wait()`` before other callbacks' ``on_train_end`` (EMA copies
       its average into the model there); later requests snapshot at once (mode ``async``).
    7. ``on_exception``, ``teardown``, ``GoCkptIO.teardown``: wait and close (backstops).

    Where a checkpoint may be captured: a multi-step checkpoint (GoCkpt §4.2) holds the state
    up to ``K - 1`` updates after its request, taken at a batch end. ``K`` is capped so that this
    batch end comes no later than the end of the epoch, the next validation run and
    ``max_steps`` (points from which a plain DataLoader or the loop cannot resume mid-way), and
    ``K = 1`` under manual optimization (several ``optimizer.step()`` per batch).
    """

    def __init__(self, *, _from_factory: bool = False) -> None:
        self._from_factory = _from_factory
        self._reset()

    def _reset(self) -> None:
        self.io: GoCkptIO | None = None
        self.engine: Engine | sharded.ShardedAdapterEngine | StagedAdapterEngine | None = None
        # "sharded" (ModelParallelStrategy), "replicated" (DDP), "gathered" (FSDPStrategy, full),
        # "fsdp_sharded" (FSDPStrategy, sharded), "deepspeed", None (one device)
        self._kind: str | None = None
        self._every_rank = False  # an engine on every rank (lightning_gockpt.sharded)
        self._synced: list[Any] | None = None  # DDP: the parameters DDP averages (on_fit_start)
        self._zero = True  # global rank 0
        self._trainer: Trainer | None = None
        self._finished: list[_Handle] = []
        self._finished_lock = threading.Lock()
        self._pending: list[_Handle] = []
        # Deferred removals: (path, its directory key, the first request number it waits for,
        # own, needs): ``own`` the number of the path's newest request at the removal (0: none
        # in this run), ``needs`` the checkpoints that may stand in for it, (request number,
        # key): first the newest request of another path of its folder then (the checkpoint
        # replacing it), then what replaced that one where it was removed before it was durable;
        # see _released. Every request since the oldest ``first``, in order (number, handle).
        self._deferred: list[tuple[str, str, int, int, tuple[tuple[int, str], ...]]] = []
        self._requests: list[tuple[int, _Handle]] = []
        self._seq = 0
        self._newest: dict[str, int] = {}  # key -> number of its newest request (until removed)
        self._seq_of: weakref.WeakKeyDictionary[_Handle, int] = weakref.WeakKeyDictionary()
        self._durable_seq: dict[str, int] = {}  # folder -> number of its newest durable request
        self._durable_key_seq: dict[str, int] = {}  # key -> number of its newest durable request
        # Request number -> whether it ended durable, for the requests a removal may wait for
        # (each key's newest, the deferred ones' ``need``; pruned at batch ends).
        self._ended_ok: dict[int, bool] = {}
        self._removing: set[str] = set()  # keys a done callback is deleting now
        # Guards the removal state above: a save's done callback (an engine thread) carries out
        # the removals it releases (_release_now). Held around updates of that state only,
        # never around storage I/O or an engine call that waits for the engine's threads.
        self._removal_lock = threading.RLock()
        self._removal_done = threading.Condition(self._removal_lock)
        # Each save's directory (gockpt.fsutil.path_key), taken once at its request: the
        # deferred removals compare them at every batch end.
        self._dir_keys: weakref.WeakKeyDictionary[_Handle, str] = weakref.WeakKeyDictionary()
        self._num_batches = 0
        self._edits_after_batch_end = False  # see _may_edit_after_batch_end (on_train_start)
        # (engine version, the fit loop's state) at the first batch end of the latest version
        # reached while a save was still to be captured, and the version at the previous batch
        # end (see _batch_end, state_fn).
        self._last_loops: tuple[int, dict] | None = None
        self._batch_end_version: int | None = None
        self._ended = False
        self._failed = False
        self._logging = False
        self._exit_token = -1
        self._step_hooks: list[Any] = []  # optimizer step pre-hooks (see _step_without_us)
        self._user_order: list[Callback] | None = None  # trainer.callbacks as setup found them
        # The dict of the latest full (not weights-only) dump_checkpoint: Lightning calls the
        # callbacks' on_save_checkpoint for those only. Held until the request that takes it.
        self._full_dump: dict[str, Any] | None = None
        self._dump_before: dict[str, Any] | None = None  # the one it replaced (forget_dump)

    # A copy (``copy.deepcopy(trainer.callbacks)``, pickling for ``ddp_spawn``) is an unlinked
    # callback: engines, threads and locks stay with the original.
    def __getstate__(self) -> dict[str, Any]:
        return {"_from_factory": self._from_factory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._from_factory = state["_from_factory"]
        self._reset()

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(getattr(io, "checkpoint_io", None), GoCkptIO):
            raise ValueError("GoCkptIO already saves in the background; do not wrap it in AsyncCheckpointIO")
        if not isinstance(io, GoCkptIO) or _linking_callback(trainer) is not self:
            return
        kind = sharded.strategy_kind(trainer.strategy)
        if kind == "replicated" and trainer.world_size < 2:
            kind = None  # one DDP process: the single-writer path
        self._kind, self._zero = kind, trainer.is_global_zero
        # DDP: decided in on_train_start, with the optimizers.
        self._every_rank = kind in ("sharded", "deepspeed", "fsdp_sharded")
        if kind is not None:
            sharded.install(trainer.strategy, self, kind)
        if kind in ("gathered", "fsdp_sharded", "deepspeed") and io.config.mode in MULTI_STEP_MODES:
            # Their state (flat parameters, ZeRO partitions) is not tracked by the engine.
            warnings.warn(f"GoCkptIO: {type(trainer.strategy).__name__} checkpoints are captured at their "
                          f"request (mode {io.config.mode!r} needs an engine over the live state): the "
                          "write is done in the background, with no multi-step overlap", stacklevel=2)
        self.io, self._trainer = io, trainer
        io._callback = self
        _registry.register(self)
        cbs: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self._user_order is None:  # given back at teardown: the run leaves the list as it was
            self._user_order = [cb for cb in cbs if not isinstance(cb, _BatchEnd)]
        if cbs and cbs[0] is not self:
            cbs.remove(self)
            cbs.insert(0, self)
        # The step boundary is taken where ModelCheckpoint saves: after every other callback's
        # on_train_batch_end (an EMA update of that step belongs to it), before the checkpoints.
        cbs[:] = [cb for cb in cbs if not isinstance(cb, _BatchEnd)]
        first_ckpt = next((i for i, cb in enumerate(cbs) if isinstance(cb, Checkpoint)), len(cbs))
        cbs.insert(first_ckpt, _BatchEnd(self))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Right after the strategy wrapped the model (this callback runs first): under DDP, the
        # parameters whose gradients DDP averages are those requiring them now. A later unfreeze
        # trains one copy per rank (gockpt.sharded.ReplicasDifferError), engine rebuilds or not.
        self._synced = [p for p in pl_module.parameters() if p.requires_grad]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ended = self._failed = False
        if self._kind == "replicated" and self.io is not None:
            # Else (a ZeRO optimizer, an object store) rank 0 writes, through GoCkptIO.
            self._every_rank = sharded.shares_write(trainer, self.io.config.storage_options)
        if self.io is None or not (trainer.is_global_zero or self._every_rank):
            return
        if trainer.is_global_zero:
            self._logging = bool(getattr(self.io, "log_metrics", False))
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and getattr(cb, "dirpath", None):
                    cleanup_staging(str(cb.dirpath), self.io.config.storage_options)
                    tidy_placeholders(str(cb.dirpath), self.io.config.storage_options)
        self._edits_after_batch_end = _may_edit_after_batch_end(trainer, self)
        if self.engine is None:
            self.engine = self._build(trainer)
            # A run can end without teardown (an exception in a ddp_spawn worker runs no hook):
            # the saves in flight and the top-k removals behind them are finished at exit.
            self._exit_token = _exit.register(self._close_at_exit)
            self._hook_steps(trainer.optimizers)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # First of the callbacks (setup puts this one first), so before any hook edits the dict.
        # The one before is kept for forget_dump: a signal handler's dump may come between a
        # request's dump and the request.
        self._dump_before, self._full_dump = self._full_dump, checkpoint

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.engine is not None:
            tracked = getattr(self.engine, "optimizers", None)  # None: a staged engine (it tracks none)
            raw = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
            if tracked is not None and not any(raw is o for o in tracked):
                # An optimizer the engine does not know (the loop replaced them since the last
                # batch end): the loop's state already differs from any step the saves still to
                # be captured could hold (the dict holds the new optimizer, the forward moved the
                # buffers), so they are not written (a warning each), never torn; the captured
                # ones are finished now. The engine follows the new optimizers at the batch end
                # (_follow_optimizers).
                n = self.engine.abandon_uncaptured("the optimizers were replaced before its captured step")
                if n:
                    log.warning("gockpt: the optimizers were replaced while %d checkpoint(s) were still to "
                                "be captured; they are not written", n)
                self.engine.flush()  # the captured ones finish their copies before this update
                return
            self.engine.before_update()

    def _batch_end(self) -> None:
        self._num_batches += 1
        self._full_dump = self._dump_before = None  # a dump no save took (a dict copied by user code) is not held on
        if self.engine is not None and self._trainer is not None:
            self._follow_optimizers(self._trainer)
        if self.engine is not None:
            trainer = self._trainer
            self.engine.step_end()
            if self._edits_after_batch_end and hasattr(self.engine, "finish_captured"):
                # The module's batch-end hook (run after every callback's) or the next batch's
                # start hooks may change weights: the block a save taken just now still copies
                # is finished first, as stock's save here read it before them.
                self.engine.finish_captured()
            if trainer is not None and trainer.should_stop:
                # A callback stopped the run here (a Timer, a custom stop): the loop may end
                # before the batch end a save in flight was to be captured at, and its state
                # after this one is no batch end's. Captured here, as stock saves here.
                self.engine.flush()
            version = self.engine.version
            first = version != self._batch_end_version  # an update since the last batch end
            self._batch_end_version = version
            if first and trainer is not None and any(
                    getattr(h, "captured_step", 0) is None and not h.done() for h in self._pending):
                # A save is to be captured at a later step. If the loop stops first (a stop
                # inside an accumulation, on_train_batch_start returning -1, an exception), it
                # is captured where the loops have moved on from this batch end, the one stock
                # saves this step's state at; the weights are this step's still, so it takes the
                # loops' state as of here.
                self._last_loops = (version, copy.deepcopy(trainer.fit_loop.state_dict()))
            self._log_finished(in_step=True)
            self._remove_deferred()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Only where other code runs here that may swap weights in (SWA transfers its average
        # through .data): otherwise the copy of a save requested at the epoch's end (stock's
        # ModelCheckpoint default) goes on under the first step, as at any other step.
        if _may_edit_at_epoch_start(trainer, self):
            self._flush()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ended = True
        if self.engine is not None:
            self.engine.wait()
            self._log_finished()
            self._remove_deferred()
        self._logging = False  # the loggers are finalized after this hook

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._ended = self._failed = True
        if self.engine is not None:
            try:
                self.engine.wait()
            except Exception:  # the run's own exception is the one to raise
                log.exception("gockpt: finishing checkpoints after %r failed", exception)
            self._log_finished()
        self._logging = False  # the loggers are finalized after this hook

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        try:
            self.close()
        finally:
            self._synced = None  # no reference to the run's parameters outlives it
            self._restore_order(trainer)

    # ------------------------------------------------------------------ used by GoCkptIO

    @property
    def active(self) -> bool:
        """Whether an engine is running (between ``on_train_start`` and ``close``)."""
        return self.engine is not None

    @property
    def trainer(self) -> Trainer | None:
        """The Trainer this callback was set up with (None before ``setup``)."""
        return self._trainer

    def forget_dump(self, checkpoint: dict[str, Any]) -> None:
        """``checkpoint`` is saved without a request (blocking): the flag its dump set is not
        for the next request."""
        if self._full_dump is checkpoint:
            self._full_dump, self._dump_before = self._dump_before, None

    @property
    def every_rank(self) -> bool:
        """Whether every rank runs an engine and requests each save (sharded or DDP shares)."""
        return self._every_rank

    def is_monitored(self, path: str) -> bool:
        """Whether ``path`` is being saved as a ModelCheckpoint's metric-ranked (top-k) checkpoint."""
        return self._trainer is not None and any(
            isinstance(cb, ModelCheckpoint) and cb.monitor is not None and path in cb.best_k_models
            for cb in self._trainer.checkpoint_callbacks)

    def request(self, checkpoint: dict[str, Any], path: str, *,
                exact_step: bool) -> _Handle | None:
        """Request a checkpoint of Lightning's ``checkpoint`` dict at ``path`` (training thread).

        The dict is the source of truth: its tensors that are the live parameters and optimizer
        state take the engine's overlapped path, any other tensor is copied when the dict is
        taken (:mod:`gockpt.snapshot`).

        Returns:
            The save's handle; None on a DDP rank that stopped writing at this request (the
            replicas may differ: rank 0 writes from here on, :class:`gockpt.sharded.ReplicasDifferError`).
        """
        trainer = self._trainer
        assert self.io is not None and trainer is not None and self.engine is not None
        self._follow_optimizers(trainer)
        if self.engine is None:
            return None  # the optimizers were replaced by ones the ranks cannot share: rank 0 writes
        engine = self.engine
        # A weights-only save (save_weights_only, Trainer.save_checkpoint(weights_only=True)) is
        # told by the hook that runs for full dumps only, not by the dict's keys: a module hook
        # may drop "optimizer_states" from a full one, and a re-dump at a later captured step
        # must then still hold the callbacks' and schedulers' state and run their hooks (an
        # averaging callback swaps its weights in there). The keys are the fallback where that
        # hook did not see this dict (callbacks swapped out by the tuner).
        full, self._full_dump, self._dump_before = self._full_dump is checkpoint, None, None
        weights_only = not full and "optimizer_states" not in checkpoint
        at_version = engine.version
        # FSDPStrategy (full): the dict holds the state gathered at the request, and dumping it
        # again is a collective the other ranks do not join; it is taken at once (K = 1).
        gathered = self._kind == "gathered"
        # The gathered dict is a whole copy of the state: handed over once, so that only the
        # engine's snapshot of it stays alive while the save is in flight.
        held = [checkpoint]

        def take_gathered() -> dict[str, Any]:
            if not held:
                raise RuntimeError("gockpt: the gathered checkpoint dict was already taken")
            return {"lightning": held.pop()}

        def state_fn() -> dict[str, Any]:
            # Called at the captured step. Later than the request, Lightning's dict is taken
            # again so that loops, schedulers, callbacks and hook edits match the tensors.
            now = engine.version
            if now == at_version:
                # No update since the request: its own state. (Batch ends are no measure: a
                # capture that a later step's request makes before this callback's batch end
                # of that step comes after an update.)
                return {"lightning": held[0]}
            ck = trainer._checkpoint_connector.dump_checkpoint(weights_only)
            self._full_dump = None  # this re-dump is no request's
            last = self._last_loops
            if last is not None and last[0] == now and "fit_loop" in ck.get("loops", {}):
                # Past the first batch end of this step (see _batch_end): that one's loops.
                ck["loops"]["fit_loop"] = copy.deepcopy(last[1])
            return {"lightning": ck}

        key = path_key(path)
        with self._removal_lock:  # after a removal the done callback is carrying out, if any
            self._removal_done.wait_for(lambda: key not in self._removing)
            self._deferred = [d for d in self._deferred if d[1] != key]  # replaced, not removed
        if self._zero:
            make_placeholder(path, self.io.config.storage_options)
        cap = 1 if exact_step or gathered else 1 + _updates_left(trainer, engine.config.max_overlap_steps)
        if gathered:
            # It tracks no optimizer: its manifests record Lightning's step as the others' do
            # (they recorded 0, and an incomplete last.ckpt resolved to any checkpoint beside it).
            engine.version = trainer.global_step
        options = self.io.config.storage_options
        mode = None
        if self._ended or (gathered and engine.config.mode != "sync"):
            mode = "async"
        # DDP shares: a weights-only save writes no optimizer state (stock's file holds none).
        only = {"weights_only": True} if weights_only and self._kind == "replicated" and self._every_rank else {}
        try:
            handle = engine.save(path, state_fn=take_gathered if gathered else state_fn, max_overlap_steps=cap,
                                 mode=mode, **only)
        except ReplicasDifferError as e:  # on every rank alike; nothing was written
            if self._zero:
                remove_placeholder(path, options)
            log.warning("gockpt: %s; rank 0 writes the checkpoints from here on, from its own copy "
                        "of the state (as stock DDP does)", str(e).removeprefix("gockpt: "))
            self._reopen(trainer, to_rank0=True)
            if not trainer.is_global_zero:
                return None
            # The dict is stock's (under DDP the strategy changes only where it is saved): rank
            # 0's request of it.
            self._full_dump = checkpoint if full else None
            return self.request(checkpoint, path, exact_step=exact_step)
        except BaseException:  # Ctrl-C inside a blocking save, a storage error: no placeholder
            if self._zero:
                remove_placeholder(path, options)
            raise
        self._dir_keys[handle] = key
        self._pending = [h for h in self._pending if not h.done()] + [handle]
        with self._removal_lock:
            self._seq += 1
            self._requests.append((self._seq, handle))
            self._newest[key] = self._seq
            self._seq_of[handle] = self._seq
        handle.add_done_callback(lambda h: self._on_done(h, options))  # may run here, at once
        return handle

    def remove(self, path: str) -> None:
        """Remove the checkpoint at ``path`` (training thread), never the newest candidate too early.

        A save of ``path`` still in flight is cancelled only when a checkpoint requested after
        it is already durable; otherwise it runs to completion and is removed afterwards, so
        that storage slower than the checkpoint interval still completes checkpoints. A complete
        checkpoint is kept until the saves requested before its removal are durable, so that a
        crash in between still finds a complete checkpoint (``ModelCheckpoint(save_top_k=1)``
        removes the previous one right after requesting the next; PCcheck §4.1).
        """
        assert self.io is not None
        if self.engine is None:
            gockpt.remove_checkpoint(path, self.io.config.storage_options)
            return
        key = path_key(path)  # the directory, however this call spells it
        parent = _parent(key)
        pending = [h for h in self._pending if not h.done()]
        own = [h for h in pending if self._dir_key(h) == key]
        with self._removal_lock:
            newest = self._newest.pop(key, 0)
            # The checkpoint replacing it: ModelCheckpoint requests the new one, then removes the
            # one it displaces (stock: once the new one is written).
            need, need_key = max(((s, k) for k, s in self._newest.items() if k != key and _parent(k) == parent),
                                 default=(0, ""))
            # The removals that waited for this path's save, not durable yet (skipped, failed, or
            # still being written), may now also be released by what replaces it, as this
            # removal is (the save in flight still counts if it becomes durable).
            self._deferred = [d[:4] + (d[4] + ((need, need_key),),) if any(k == key for _, k in d[4])
                              and not any(self._ended_ok.get(s) for s, _ in d[4]) else d for d in self._deferred]
            # Released where the checkpoint replacing it is durable (PCcheck §4.1): removed now,
            # its own saves in flight cancelled.
            released = self._released(key, newest, ((need, need_key),))
            # Else it waits while a save of the path, or of its folder, is in flight, or while
            # the newer saves of its folder were skipped or failed (when_full="skip", a
            # storage error): ModelCheckpoint removes it because it believes them written.
            newer = any(s > newest and self._dir_key(h) != key and _parent(self._dir_key(h)) == parent
                        for s, h in self._requests)
            defer = not released and bool(
                own or newer or any(self._dir_key(h) != key and _parent(self._dir_key(h)) == parent
                                    for h in pending))
            if defer:  # waits for the saves in flight and the newer ones of its folder
                first = min((s for s, h in self._requests if h in pending
                             or (s > newest and _parent(self._dir_key(h)) == parent)),
                            default=self._seq + 1)
                self._deferred.append((path, key, first, newest, ((need, need_key),)))
        if not defer:
            self.engine.remove(path)

    def _released(self, key: str, own: int, needs: tuple[tuple[int, str], ...]) -> bool:
        """Whether a removal of ``key`` may happen now: the one test every removal path applies
        (under the lock).

        Its folder must hold a durable checkpoint requested after ``own`` (the removed path's
        newest request): removals go from newer to older only, so two saves in flight at once
        never release each other's removal. Where a request of another path of the folder came
        after ``own``, the newest of them at the removal (the first of ``needs``, (request
        number, key): the checkpoint replacing it) must be durable: no other checkpoint of the
        folder (the previous ``last.ckpt``, another callback's) stands in for it, so a top-k
        folder never holds fewer complete checkpoints than stock's. If it ended without one
        (skipped, failed), ModelCheckpoint still counts it: a later durable save of that path
        releases the removal, or, once that path is removed in turn, what replaces it (added
        to ``needs`` by ``remove``; any one of them durable releases it).
        """
        durable = self._durable_seq.get(_parent(key), 0)
        if durable <= own:
            return False
        for need, need_key in needs:
            if need <= own or self._ended_ok.get(need) or self._durable_key_seq.get(need_key, 0) > need:
                return True
        return False

    def _close_at_exit(self) -> None:
        if self.engine is not None:
            self._failed = True  # no teardown ran: the run did not end normally
            self.close()

    def close(self) -> None:
        """Finish pending checkpoints and stop the engine; re-raises a background error."""
        self._full_dump = self._dump_before = None  # a dump after the last request (a save after fit) is not held on
        engine, self.engine = self.engine, None
        if engine is None:
            return
        self._hook_steps([])
        _exit.unregister(self._exit_token)
        try:
            engine.close()
        except Exception:
            if self._failed:  # the run's own exception is the one to raise
                log.exception("gockpt: a checkpoint failed while the run was stopping")
            else:
                self._failed = True
                raise
        finally:
            # Every save has ended: a deferred removal happens only where a newer checkpoint is
            # durable (also after a failed run), else the checkpoint stays as the newest one.
            self._remove_deferred()
            drain_discards()  # the files of those removed by a save's done callback, gone too

    def wait_for(self, path: str, *, own: bool = True) -> None:
        """Finish this callback's saves of ``path`` in flight (on its training thread: at once;
        elsewhere: waits until they are durable): a load of a checkpoint right after its
        request (Lightning's tuner restores its own; an evaluation Trainer inside a callback)
        reads it whole. ``own``: the load is this run's, so such a save's error is raised here
        alone (else the engine raises it at its next boundary, and the load reads what is at
        ``path``: the checkpoint before, if any).

        Raises:
            The error of such a save (``own`` only).
        """
        key = path_key(path)  # a load of ./ckpt must wait for a save of ckpt in flight
        for h in [h for h in self._pending if self._dir_key(h) == key and not h.done()]:
            if own:
                h.result()
                continue
            try:
                h.outcome()
            except Exception:  # noqa: BLE001 - its own run reports it; stock reads the file there
                pass

    # ------------------------------------------------------------------ helpers

    def _dir_key(self, h: _Handle) -> str:
        key = self._dir_keys.get(h)
        return path_key(h.path) if key is None else key

    def _follow_optimizers(self, trainer: Trainer) -> None:
        """Rebuild the engine where the loop replaced its optimizers (``trainer.optimizers = [...]``
        mid-run): the engine counts the updates of the optimizers it was built over, and its
        manifests record Lightning's steps only while it sees every update. The old engine's
        saves end first (a blocking wait, once per replacement). An engine on every rank is
        closed and built again on every rank (collective: the loop replaces the optimizers on
        every rank at the same batch)."""
        engine = self.engine
        tracked = getattr(engine, "optimizers", None)
        if tracked is None or self._kind == "gathered":
            return  # the staged engines take the state whole at the request, at its global step
        now = list(trainer.optimizers)
        if len(now) == len(tracked) and all(a is b for a, b in zip(now, tracked, strict=True)):
            return
        if not all(isinstance(o, optim.Optimizer) for o in now):
            return  # no engine can track those (as at the start): the one there goes on
        log.info("gockpt: the optimizers were replaced; the checkpoint engine is rebuilt over the new ones")
        # The new optimizers share a parameter, or consolidate their state on one rank: no share
        # of units fits them. Rank 0 writes from here on, as in a run that starts with them
        # (on_train_start); every rank takes this branch alike.
        to_rank0 = self._every_rank and self._kind == "replicated" and \
            not sharded.shares_write(trainer, self.io.config.storage_options if self.io else None)
        if to_rank0:
            log.info("gockpt: the new optimizers cannot share the write among the ranks; rank 0 writes "
                     "the checkpoints from here on")
        self._reopen(trainer, to_rank0=to_rank0)

    def _reopen(self, trainer: Trainer, *, to_rank0: bool = False) -> None:
        """Close the engine (its saves in flight end first; collective where every rank has one)
        and build the next where the run has one: rank 0, or every rank while they share the
        write (``to_rank0``: from here on rank 0 writes each checkpoint whole, as stock DDP
        does); the step pre-hooks on the loop's optimizers."""
        self._hook_steps([])
        assert self.engine is not None
        self.engine.close()  # their errors are raised here, as at a request
        if to_rank0:
            self._every_rank = False
        if not (trainer.is_global_zero or self._every_rank):
            self.engine = None
            return
        self.engine = self._build(trainer)
        self._hook_steps(list(trainer.optimizers))

    def _hook_steps(self, optimizers: list[Any]) -> None:
        """The step pre-hooks (_step_without_us) on ``optimizers``, in place of those before."""
        for h in self._step_hooks:
            h.remove()
        self._step_hooks = [opt.register_step_pre_hook(self._step_without_us)
                            for opt in optimizers if isinstance(opt, optim.Optimizer)]

    def _step_without_us(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        trainer = self._trainer
        if self.engine is None or trainer is None or self in trainer.callbacks:
            return
        # An update while trainer.callbacks does not hold this callback (the learning-rate and
        # batch-size finders swap the list out): no window end or step boundary reaches the
        # engine, so the saves in flight are finished now, at the last step it saw.
        self.engine.flush()

    def _restore_order(self, trainer: Trainer) -> None:
        order, self._user_order = self._user_order, None
        if order is None:
            return
        # A new list, not the one Lightning is iterating over to call this very hook.
        ours = [cb for cb in trainer.callbacks if not isinstance(cb, _BatchEnd)]  # type: ignore[attr-defined]
        if {id(cb) for cb in ours} == {id(cb) for cb in order}:
            trainer.callbacks = order  # type: ignore[attr-defined]
        else:  # callbacks added or removed during the run: keep that, only drop the companion
            trainer.callbacks = ours  # type: ignore[attr-defined]

    def _flush(self) -> None:
        if self.engine is not None:
            self.engine.flush()

    def _on_done(self, handle: _Handle, storage_options: Any) -> None:
        # Runs on an engine thread. A save that left no checkpoint leaves no placeholder either.
        if not _durable(handle) and self._zero:
            try:
                remove_placeholder(handle.path, storage_options)
            except OSError:
                log.warning("gockpt: could not remove the placeholder of %s", handle.path, exc_info=True)
        with self._finished_lock:
            self._finished.append(handle)
        seq = self._seq_of.get(handle)
        if seq is not None:
            with self._removal_lock:
                ok = self._ended_ok[seq] = _durable(handle)
                if ok:
                    key = self._dir_key(handle)
                    parent = _parent(key)
                    self._durable_seq[parent] = max(self._durable_seq.get(parent, 0), seq)
                    self._durable_key_seq[key] = max(self._durable_key_seq.get(key, 0), seq)
        # Durable, it may release removals; ended either way, it may unblock one of its path.
        self._release_now(handle)

    def _release_now(self, h: _Handle) -> None:
        """The deferred removals released now that ``h`` has ended (engine thread): those
        whose folder holds a durable checkpoint requested after the path's own newest save.

        Carried out here rather than at the next batch end: a crash in between would leave the
        rotated-out checkpoint on disk for good, where stock deletes it right after its blocking
        save. Only removals whose path has no save of its own in flight (cancelling one is the
        training thread's, at a batch end) are carried out; a request of the path meanwhile
        waits for it, then saves over what is gone.
        """
        if self.engine is None or self.io is None:
            return
        with self._removal_lock:
            key_h = self._dir_key(h)
            busy = {self._dir_key(x) for _, x in self._requests if not x.done()}
            ready = [d for d in self._deferred if d[1] not in busy and self._released(d[1], d[3], d[4])]
            if not ready:
                return
            self._deferred = [d for d in self._deferred if d not in ready]
            self._removing.update(d[1] for d in ready)
        # The deletion outside the lock: on a slow store it must not hold up the training
        # thread's requests and batch ends (a request of one of these paths waits for it).
        failed = []
        try:
            for entry in ready:
                try:
                    remove_now(entry[0], self.io.config)
                except Exception:  # noqa: BLE001 - a later batch end tries again
                    log.warning("gockpt: removing %s (released by %s) failed; retried later",
                                entry[0], key_h, exc_info=True)
                    failed.append(entry)
        finally:
            with self._removal_lock:
                # Released already: retried as such (its ``needs`` may be forgotten by then).
                self._deferred.extend(e[:4] + (((0, ""),),) for e in failed)
                self._removing.difference_update(d[1] for d in ready)
                self._removal_done.notify_all()

    def _remove_deferred(self) -> None:
        # A deferred path is removed once a checkpoint beside it (its folder), requested after
        # the first save in flight at the removal, is durable, or, when nothing else was saved
        # there since (the removal only waited for the path's own save), once the run has
        # ended. While one of those
        # may still become durable it waits; if they all failed or were cancelled it stays,
        # being the newest complete checkpoint there.
        assert self.io is not None
        with self._removal_lock:
            ready = self._take_ready()
        for path in ready:
            if self.engine is not None:
                self.engine.remove(path)
            else:
                gockpt.remove_checkpoint(path, self.io.config.storage_options)

    def _take_ready(self) -> list[str]:
        """The deferred paths to remove now, taken out of ``_deferred`` (under the lock)."""
        keep, ready = [], []
        for entry in self._deferred:
            path, key, first, own, needs = entry
            parent = _parent(key)
            since = [(s, h) for s, h in self._requests if s >= first and _parent(self._dir_key(h)) == parent]
            others = [h for s, h in since if s > own and self._dir_key(h) != key]
            if self._released(key, own, needs):
                ready.append(path)
            elif not all(h.done() for _, h in since):
                keep.append(entry)
            elif not others:
                # Only its own save was awaited: the newest checkpoint of its folder, kept
                # while the run goes on (a crash still finds it); removed, as asked, once the
                # run has ended.
                if self._ended or self.engine is None:
                    ready.append(path)
                else:
                    keep.append(entry)
            elif not (self._ended or self.engine is None):
                keep.append(entry)  # the newer saves there failed or were skipped: a later one may be durable
            # else: the run has ended with no newer checkpoint there: the path stays
        self._deferred = keep
        wanted = set(self._newest.values()) | {s for e in keep for s, _ in e[4]}
        self._ended_ok = {s: ok for s, ok in self._ended_ok.items() if s in wanted}
        oldest = min((e[2] for e in keep), default=self._seq + 1)
        self._requests = [(s, h) for s, h in self._requests if s >= oldest or not h.done()]
        return ready

    def _build(self, trainer: Trainer) -> Engine | sharded.ShardedAdapterEngine:
        assert self.io is not None
        # Steps in manifests and in the `latest` pointer are Lightning's global steps, so the
        # checkpoints of a resumed run rank above the ones it resumed from, whether or not its
        # optimizers keep state (plain SGD keeps none); multi-step copies wait for an update
        # where they have none yet (Planner._replayable).
        restored = trainer.global_step > 0
        if self._kind == "deepspeed":
            return deepspeed.build_engine(self, trainer)
        if self._kind == "fsdp_sharded":
            return fsdp.build_engine(self, trainer)
        if self._every_rank:
            return sharded.build_engine(self, trainer, trainer.global_step if restored else None,
                                        replicated=self._kind == "replicated")
        if self._kind in (None, "replicated") and shared_parameters(trainer.optimizers):
            # A parameter several optimizers update has no one owner to plan its copy by: its
            # checkpoints are taken whole at the request, as stock async saving does.
            log.info("gockpt: a parameter is in more than one optimizer; checkpoints are copied "
                     "at their request (mode 'async')")
            self._kind = "gathered"
        if self._kind == "gathered":
            # The strategy gathers the state into each checkpoint's dict: the engine tracks
            # nothing live and copies that dict at the request.
            return Engine(nn.Module(), [], self.io.config, explicit_before_update=True)
        return Engine(trainer.lightning_module, list(trainer.optimizers), self.io.config,
                      explicit_before_update=True, start_step=trainer.global_step if restored else None)

    def _log_finished(self, *, in_step: bool = False) -> None:
        """Send the metrics of saves that became durable since they were last sent.

        They go to ``trainer.loggers`` directly, as ``LearningRateMonitor`` does, at the step
        Lightning logs its own metrics at (``_batches_that_stepped``), so loggers see
        non-decreasing steps and the module's ``callback_metrics`` stay those of stock. In a
        batch (``in_step``) they wait for a step Lightning logs at (``log_every_n_steps``); at
        the end of a run (logging closes there) they are sent at once.
        """
        trainer = self._trainer
        if trainer is None or not self._logging or not trainer.loggers:
            with self._finished_lock:
                self._finished = []
            return
        if in_step and not trainer._logger_connector.should_update_logs:
            return  # kept for the next step that logs
        with self._finished_lock:
            done, self._finished = self._finished, []
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        for handle in done:
            if not _durable(handle):
                continue
            metrics = handle.outcome(0).log_dict()
            for logger in trainer.loggers:
                logger.log_metrics(metrics=metrics, step=step)


def _may_edit_at_epoch_start(trainer: Trainer, own: Callback) -> bool:
    """Whether a callback (other than Lightning's that only show or log: progress bars, the
    learning-rate monitor, the accumulation scheduler) or the module defines
    ``on_train_epoch_start``: code that may change weights outside ``optimizer.step()``."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if cb is own or isinstance(cb, (_BatchEnd, *_SHOW_AT_EPOCH_START)):
            continue
        # Not found on its type (a callback-like object): it may define it, so it counts.
        if getattr(type(cb), "on_train_epoch_start", None) is not Callback.on_train_epoch_start:
            return True
    module = trainer.lightning_module
    return module is not None and type(module).on_train_epoch_start is not LightningModule.on_train_epoch_start


def _may_edit_after_batch_end(trainer: Trainer, own: Callback) -> bool:
    """Whether code that runs after GoCkpt's batch end and before the next forward may change
    weights outside ``optimizer.step()``: the module's ``on_train_batch_end`` or
    ``on_train_batch_start``, or a callback's ``on_train_batch_start`` (other than Lightning's
    that only show or log, and the checkpoint callbacks)."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if cb is own or isinstance(cb, (_BatchEnd, Checkpoint, *_SHOW_AT_BATCH)):
            continue
        # Not found on its type (a callback-like object): it may define it, so it counts.
        if getattr(type(cb), "on_train_batch_start", None) is not Callback.on_train_batch_start:
            return True
    module = trainer.lightning_module
    return module is not None and (
        type(module).on_train_batch_end is not LightningModule.on_train_batch_end
        or type(module).on_train_batch_start is not LightningModule.on_train_batch_start)


class _BatchEnd(Callback):
    """The batch-end half of :class:`GoCkptCallback`, placed right before the checkpoint callbacks."""

    def __init__(self, owner: GoCkptCallback | None) -> None:
        self.owner = owner

    def __getstate__(self) -> dict[str, Any]:  # a copy is inert, like its owner's
        return {"owner": None}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.owner is not None:
            self.owner._batch_end()


def _updates_left(trainer: Trainer, limit: int) -> int:
    """Optimizer updates the loop may still run before a point a checkpoint must not cross.

    Those points are the end of the epoch (a plain DataLoader cannot resume mid-epoch where
    stock resumes the next one), the next validation run (its hooks may change weights and it
    counts in the loop state) and ``max_steps``. Counted up to ``limit``; 0 under manual
    optimization (several ``optimizer.step()`` per batch) or when the horizon is unknown.
    """
    if not trainer.lightning_module.automatic_optimization or not trainer.training:
        return 0
    loop = trainer.fit_loop.epoch_loop
    n = trainer.num_training_batches
    ready = loop.batch_progress.current.ready  # batches of this epoch started so far
    if n == float("inf") or ready >= n:
        return 0
    n = int(n)
    last = n - 1  # last batch index the capture may land on
    if trainer.enable_validation and loop._should_check_val_epoch():
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            return 0
        vcb = trainer.val_check_batch
        if vcb is not None and vcb != float("inf"):
            vcb = int(vcb)
            cur = loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx
            ahead = (-(cur + 1)) % vcb  # batches until one that runs validation after it
            last = min(last, ready - 1 + ahead)
    acc = trainer.accumulate_grad_batches
    count = 0
    for b in range(ready, last + 1):
        if (b + 1) % acc == 0 or b == n - 1:
            count += 1
            if count >= limit:
                break
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        count = min(count, max(0, trainer.max_steps - trainer.global_step))
    return count


def _parent(key: str) -> str:
    """The folder of a checkpoint's directory key (:func:`gockpt.fsutil.path_key`)."""
    return key.rstrip("/").rpartition("/")[0]


def _durable(handle: _Handle) -> bool:
    if not handle.done():
        return False
    try:
        handle.outcome(0)
    except BaseException:  # cancelled or failed: the engine raises it at its next boundary
        return False
    return not handle.skipped


def _linking_callback(trainer: Trainer) -> GoCkptCallback:
    ours = [cb for cb in trainer.callbacks if isinstance(cb, GoCkptCallback)]  # type: ignore[attr-defined]
    explicit = [cb for cb in ours if not cb._from_factory]
    return (explicit or ours)[0]
