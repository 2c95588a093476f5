"""The engine: multi-step overlapped checkpoints with gradient assist and exact CPU replay.

Call sequence of one checkpoint in a multi-step mode (K windows, requested at update N), with the
thread each step runs on (GoCkpt §4.2-§4.4):

1. (training thread) ``save()`` right after update N: plan K and the blocks, take a host slot
   (or share the snapshot of a save requested at step N: :mod:`gockpt._record`), queue the D2H
   copy of block 0.
2. (copy worker / CUDA stream) block j is copied during window j, the forward/backward between
   updates N+j and N+j+1, when it cannot change.
3. (training thread, window end: step pre-hook or ``before_update()``) wait for block j's copy.
4. (training thread, step post-hook of update N+j+1) copy the gradients of blocks 0..j that this
   update applied (``gockpt``: the training thread waits; ``gockpt_o``: overlapped with the next
   forward, guarded until the gradients could be overwritten) and record the hyperparameters.
5. (replay worker) apply those gradients to the host copies of blocks 0..j with the optimizer's
   own update rule: every block reaches version N+K-1.
6. (training thread, first step boundary at version N+K-1) take the non-tensor state
   (``state_fn``), buffers and optimizer param groups: the captured step.
7. (persist pool + I/O threads) the files (GoCkpt's shards or a writer's, :mod:`gockpt.writer`),
   then the manifest, the atomic publish and the ``latest`` pointer (PCcheck §4.1).

``lazy`` is K = 1 (DataStates-LLM §V-A2); ``async`` copies all at the request; ``sync`` also persists.

:class:`Engine` is a facade: planning is in :mod:`gockpt._planner`, the save record in
:mod:`gockpt._record`, steps 1, 3, 4, 6 in :mod:`gockpt._windows`, 5, 7 in :mod:`gockpt._pipeline`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from time import perf_counter
from typing import Any

from torch import nn
from torch.optim import Optimizer

from . import _exit
from ._hooks import EngineHook, StepPreHook, load_hooks
from ._pipeline import Pipeline
from ._planner import Planner, ReplayBackends, infer_step, model_device, probe_copy_bandwidth
from ._pointer import MAX_RUN
from ._record import Phase, SaveRecord, make_record
from ._windows import Windows
from .config import GoCkptConfig
from .errors import CheckpointCancelledError
from .fsutil import SCRATCH_RE, is_local, path_key, url_to_fs
from .fsutil import split as split_path
from .handle import CheckpointMetrics, SaveHandle
from .layout import Entry, StateLayout, shared_parameter, shared_parameter_error
from .plan import MULTI_STEP_MODES
from .replay import is_replayable
from .restore import load_checkpoint, load_into
from .storage import (
    BackgroundDeleter,
    check_save_path,
    claim_directory,
    cleanup_staging,
    newest_run,
    remove_checkpoint,
)
from .transfer import SlotPool, make_copier
from .writer import CheckpointWriter

log = logging.getLogger("gockpt")


class Engine:
    """Checkpoints a model and its optimizers without stopping training.

    Args:
        model: the module whose ``state_dict(keep_vars=True)`` holds parameters and buffers.
        optimizers: the torch optimizer(s) training it (the inner optimizers: step hooks are
            registered on them).
        config: options; defaults when None.
        explicit_before_update: the caller signals the end of each copy window with
            :meth:`before_update` (frameworks running forward/backward inside
            ``optimizer.step(closure)``, where the step pre-hook fires before the forward).
        start_step: optimizer updates already applied (a resumed run); None reads it from the
            optimizers' ``step`` state (summed over the optimizers; 0 for one without it).
            Checkpoints record steps from here. The ``latest`` pointer moves to this engine's
            checkpoints over those of any run before it, and within its own only forward in
            steps (:func:`gockpt.storage.advance_latest`).

    Attributes:
        version: optimizer updates applied: the step a checkpoint requested now records. It
            counts the updates of ``optimizers``; an engine that tracks none (it copies the
            state ``state_fn`` gives, at the request) never moves it, and its owner sets it to
            its own step count before each save.

    Raises:
        TypeError: ``optimizers`` holds something that is not a ``torch.optim.Optimizer``.
        ValueError: a parameter is in two optimizers' param groups, or twice in one (a later
            ``add_param_group`` that does so fails the next save with the same error); the
            model's parameters and buffers are on more than one CUDA device.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Optimizer | Sequence[Optimizer],
        config: GoCkptConfig | None = None,
        *,
        explicit_before_update: bool = False,
        start_step: int | None = None,
    ) -> None:
        self.config = config or GoCkptConfig()
        self.model = model
        self.optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
        for o in self.optimizers:
            if not isinstance(o, Optimizer):
                raise TypeError(f"expected torch.optim.Optimizer, got {type(o).__name__}")
        where = shared_parameter(self.optimizers)
        if where is not None:  # else the first save would fail, after the run has begun
            raise ValueError(shared_parameter_error(where))
        cuda = sorted({str(t.device) for t in (*model.parameters(), *model.buffers(),
                                               *(p for o in self.optimizers for g in o.param_groups
                                                 for p in g["params"]))
                       if t.device.type == "cuda"})
        if len(cuda) > 1:
            # One copy stream and its events on one device: a copy from another device runs on
            # that device's own stream, which the events do not cover (a torn snapshot).
            raise ValueError(f"the model's tensors are on {len(cuda)} CUDA devices ({', '.join(cuda)}); "
                             "GoCkpt's engine copies from one device: one engine per device's "
                             "model (one rank per GPU), or a blocking save")
        self.explicit_before_update = explicit_before_update
        self.metrics: list[CheckpointMetrics] = []
        self.version = infer_step(self.optimizers) if start_step is None else start_step
        self._seq = itertools.count()
        self._all: list[SaveRecord] = []  # every save whose handle may not be resolved yet
        self._closed = False
        self._pid = os.getpid()  # a forked child has none of its threads (_check_process)
        self._skips = 0  # requests skipped for want of a free host slot (when_full="skip")
        self._deleter = BackgroundDeleter()  # deletes removed checkpoints' files
        self._cleaned_dirs: set[str] = set()
        self._claims: list = []  # one writer per checkpoint directory (gockpt.storage.claim_directory)
        # The run its checkpoints record (gockpt._pointer): from its start, per directory raised
        # above the newest run there at the first save; a load into the state starts a new one.
        self._run_start = time.time_ns()
        self._runs: dict[str, int] = {}

        device = model_device(model)
        self._copier = make_copier(device, self.config.chunk_bytes, self.config.host_link_bytes_per_s)
        budget = self.config.host_buffer_bytes  # None: one snapshot, shared by same-step saves
        self._slots = SlotPool(1 if budget is None else self.config.max_inflight,
                               pin=device.type == "cuda", max_bytes=budget)
        self._backends = ReplayBackends(self.optimizers, self.config)
        # The pipeline's threads keep the engine alive (through on_durable) until close().
        self._pipeline = Pipeline(self.config, self.optimizers, self._backends, self._slots,
                                  on_durable=lambda m: self.metrics.append(m))
        self._windows = Windows(model, self.optimizers, self._copier, self._pipeline, self.config)
        self._hooks = []
        for i, o in enumerate(self.optimizers):
            self._hooks.append(o.register_step_pre_hook(
                # Only where the step is the optimizer's own update rule: SAM-like steps write
                # the weights before they call the closure.
                StepPreHook(partial(self._on_pre_hook, i),
                            self._windows.closure_end if is_replayable(o) else None,
                            self._windows.closure_end if explicit_before_update else None)))
            self._hooks.append(o.register_step_post_hook(EngineHook(partial(self._on_post_hook, i))))
            self._windows.wrap_zero_grad(o)
        self._hooks.append(model.register_forward_pre_hook(EngineHook(self._on_forward)))
        # load_state_dict overwrites live tensors in place. One into the whole model (a restore,
        # a rollback) ends the saves in flight at the state before it; one into a part of it (a
        # target network's sync, a refreshed teacher) belongs to the step, as an edit does.
        self._hooks += load_hooks(model, self.optimizers, self._before_load, self._before_part_load)
        self._exit_token = _exit.register(self._close_at_exit)
        self._planner = Planner(model, self.optimizers, self.config, self._copier,
                                probe_copy_bandwidth(self._copier, device,
                                                     self.config.host_link_bytes_per_s),
                                self._pipeline.replay_bytes_per_s,
                                self._pipeline.replay_backlog_bytes)
        if self.config.mode in MULTI_STEP_MODES + ("auto",):
            # The replay self-check runs here, not inside a save's stall.
            self._backends.select_replayable()

    # ------------------------------------------------------------------ public API

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory (pinned on CUDA) the engine holds now for snapshots and gradient
        buffers (allocated once and reused, in use or not)."""
        return self._slots.bytes

    @property
    def peak_host_bytes(self) -> int:
        """The most bytes of snapshot and gradient host buffers the engine held at once."""
        return self._slots.peak_bytes

    def _held_estimate(self, layout: StateLayout) -> Callable[[Entry], bool] | None:
        """For the plan (``frozen_copy="when_changed"``): whether the slot of the latest save
        still holds a tensor unchanged. The next save most likely gets that slot back."""
        slot = self._windows.last_slot()
        if slot is None or not len(slot.held):
            return None
        offsets = self._planner.slot_layout(layout).offsets
        return lambda e: slot.held.likely_holds(offsets[e.key], e.versioned, e.tensor)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        state_fn: Callable[[], Any] | None = None,
        exact_step: bool = False,
        mode: str | None = None,
        max_overlap_steps: int | None = None,
        writer: CheckpointWriter | None = None,
    ) -> SaveHandle:
        """Request a checkpoint of the state after the latest optimizer update.

        Call on the training thread at a step boundary (after ``optimizer.step()`` and the
        scheduler step). Returns after the request's stall only. A request at the step of a save
        in flight shares its host snapshot when that save's captured step is one this request
        allows (one copy; own files, state and handle); else it takes a free host slot, waiting
        (counted as stall) or skipping when none is free, as ``config.when_full`` says.

        Args:
            path: checkpoint directory (local path or fsspec URL). A local path is taken as it
                names a directory at the request (:func:`gockpt.fsutil.path_key`: absolute, its
                parent's symlinks resolved) and written there; the handle and the metrics carry
                that spelling.
            state_fn: returns the non-tensor state (loop counters, scheduler, RNG, ...); called on
                the training thread at the captured step and serialized at once (deep copy).
            exact_step: hold exactly the requested step (K = 1).
            mode: override of ``config.mode`` for this checkpoint.
            max_overlap_steps: upper bound on K for this checkpoint only (>= 1), e.g. the
                updates left before a point the caller cannot resume from (an epoch end); it
                also lowers ``config.min_overlap_steps``.
            writer: how this checkpoint becomes files (:mod:`gockpt.writer`); None: GoCkpt's.

        Returns:
            A :class:`SaveHandle`; ``result()`` gives :class:`CheckpointMetrics`.

        Raises:
            RuntimeError: the engine is closed, or belongs to the parent of this forked process;
                a background error of an earlier checkpoint.
            ValueError: unknown mode; ``host_buffer_bytes`` too small for one checkpoint;
                ``path`` names no directory (``/``), or a name GoCkpt keeps
                (:func:`gockpt.storage.check_save_path`).
            FileExistsError: ``path`` is a local directory that is not empty and holds no
                checkpoint: a save would replace it whole.
        """
        self._check_process()
        if self._closed:
            raise RuntimeError("engine is closed")
        self._pipeline.raise_errors()
        self._windows.boundary(self.version)
        # The directory as it is named now (a local path absolute, its parent's symlinks
        # resolved): the persist writes there even if the process changes directory or a
        # parent symlink is re-pointed before it runs, and saves match one another by it.
        path = path_key(path)
        check_save_path(path, update_latest=self.config.update_latest,
                        framework_names=getattr(writer, "framework_names", None))
        t0 = perf_counter()
        if not getattr(writer, "staging", None):  # a writer with its staging folder made already
            self.finish_enclosing(path)           # calls it itself, before making it
        parent = split_path(path)[0]  # "/ckpt": the root, not the working directory
        setup = False
        key = self._claim_key(parent)
        if key not in self._cleaned_dirs and getattr(writer, "claim_directory", True):
            setup = True
            # One writing process per directory, then scratch files of writers killed mid-save.
            claim = claim_directory(parent, self.config.storage_options,
                                    timeout_s=self.config.storage_timeout_s)
            self._claims.append(claim)
            cleanup_staging(parent, self.config.storage_options)
            self._cleaned_dirs.add(key)
        # The run its manifest records: the first save here reads the directory's newest.
        known = key in self._runs
        run = self._run_for(key, parent)
        setup |= not known and key in self._runs  # it read the directory just now
        built = self._planner.layouts_built
        layout, model_sd = self._planner.current_layout()
        # One-time costs (a directory claimed, a layout enumerated, the replay self-check) are
        # counted as "setup": the per-save fixed cost the planner adds leaves them out.
        setup |= self._planner.layouts_built != built
        if max_overlap_steps is not None and max_overlap_steps < 1:
            raise ValueError(f"max_overlap_steps must be >= 1, got {max_overlap_steps}")
        mode = mode or self.config.mode
        # Gradients are written in place right after updates: their copy may not overlap.
        grad_overlap = not self._pipeline.grads_written
        if mode == "gockpt_o" and not grad_overlap:
            mode = "gockpt"
        if mode not in ("sync", "async") and self._windows.edited_since_update():
            # Edited outside optimizer.step() (a weight swap around this save): the editor may
            # change them back before a later copy runs, so copy at the request, as stock does.
            log.info("gockpt: %s: parameters changed outside optimizer.step(); copied at the "
                     "request (async)", path)
            mode = "async"
        elif mode not in ("sync", "async") and self._windows.edits_between_updates:
            # The loop edits weights between updates (seen before): an edit inside a copy window
            # would fail this save, so it is copied before the loop goes on.
            mode = "async"
        exact = exact_step or max_overlap_steps == 1
        if self._planner.may_replay(layout, mode, exact, self.version):
            setup |= self._backends.select_all()  # the first time: the replay self-check
        t_setup = perf_counter()
        interval = self._planner.note_request(self.version)
        if self._slots.max_slots > 1:
            interval = None  # the next request takes a slot of its own: no wait, no flush
        plan = self._planner.plan(layout, mode, exact, max_overlap_steps, version=self.version,
                                  window_s=self._windows.window_s,
                                  overhead_samples_s=self._windows.overhead_samples_s,
                                  unchanged=self._held_estimate(layout), interval_steps=interval,
                                  step_s=self._windows.step_s, grad_overlap=grad_overlap)
        seq = next(self._seq)
        fixed = self._windows.fixed_stall_s(plan.mode)
        metrics = CheckpointMetrics(path=path, mode=plan.mode, num_overlap_steps=plan.num_overlap_steps,
                                    requested_step=self.version,
                                    predicted_stall_s=plan.predicted_stall_s + fixed,
                                    predicted_replay_wait_s=plan.replay_wait_s,
                                    stall_lower_bound_s=plan.lower_bound_s + fixed,
                                    expected_interval_steps=interval,
                                    planned_window_s=plan.window_s if plan.costed
                                    and plan.mode not in ("sync", "async") else None)
        if setup:
            metrics.add_stall("setup", t_setup - t0)
        handle = SaveHandle(path, metrics)
        handle._flush = self._flush_windows
        self._all = [x for x in self._all if not x.handle.done()]  # drop finished saves' slots first
        s, leader = make_record(self._slots, self._all, self._planner, seq=seq, path=path, handle=handle,
                                plan=plan, layout=layout, state_fn=state_fn, version=self.version,
                                t_request=t0, writer=writer, flush=self._flush_windows, config=self.config,
                                step_s=self._windows.step_s)
        if s is None:
            metrics.skipped = True
            handle._future.set_result(metrics)
            # A loop that never reads handles (Lightning, Accelerate) learns of it here: the
            # first skip is a warning, later ones are logged at INFO, so a run is not flooded.
            self._skips += 1
            log.log(logging.WARNING if self._skips == 1 else logging.INFO,
                    "gockpt: skipped checkpoint %s: no host slot was free for it (when_full=%r; a "
                    "sharded save skips on every rank when one has none)%s", path, self.config.when_full,
                    "; later skips are logged at INFO" if self._skips == 1 else f" ({self._skips} so far)")
            return handle
        self._all.append(s)
        s.run = run
        try:
            if leader is not None:
                # It copies nothing: what it waits for is the fixed cost of the leader's mode
                # (a flush of the leader's windows is counted as the leader's stall).
                fixed = self._windows.fixed_stall_s(leader.plan.mode)
                metrics.predicted_stall_s = metrics.stall_lower_bound_s = fixed
                metrics.predicted_replay_wait_s = 0.0
                return self._windows.join(leader, s, t0, self.version, model_sd=model_sd)
            return self._windows.start(s, t0, self.version, model_sd=model_sd)
        except BaseException as e:
            # Nothing of this request may linger: the slot goes back, the handle fails.
            s.cancel.set()
            self._windows.drop(s)
            s.drain()
            if not s.handle.done():
                self._slots.release(s.slot)
                s.handle._future.set_exception(e)
                s.phase = Phase.FAILED
            raise

    def step_end(self) -> None:
        """Mark a step boundary (after the optimizer and scheduler steps).

        Checkpoints whose captured step is the current step take their non-tensor state here.
        Where the step before was marked too, the last block of such a multi-step checkpoint is
        queued for its copy right after (its capture reads from the device, and on a GPU a read
        queued behind that copy waited for all of it); else at the update. A loop that never
        calls this has that state taken at the next update's window end instead.

        Raises:
            A background error of an earlier checkpoint (after this boundary's captures): a
            boundary, not an optimizer update, is where the engine raises them, so no update is
            skipped by one.
        """
        self._step_end(raise_errors=True)

    def _step_end(self, *, raise_errors: bool) -> None:
        """:meth:`step_end`; ``raise_errors`` False leaves background errors for the next
        request, ``wait`` or ``close`` (the sharded engine raises them there on every rank)."""
        self._check_process()
        self._windows.step_end(self.version)
        if raise_errors:
            self._pipeline.raise_errors()

    def before_update(self) -> None:
        """End the copy window: called right before an optimizer update (explicit mode).

        Waits for the block copied in this window (counted as stall). Raises no background
        error: an exception here would skip the update (they are raised at ``step_end``, the
        next request, ``wait`` and ``close``).
        """
        self._check_process()
        self._windows.window_end(self.version)

    def abandon_uncaptured(self, reason: str) -> int:
        """Fail every pending checkpoint whose captured step was not reached yet with
        :class:`~gockpt.errors.CheckpointTornError` (logged as a warning, not raised by the
        engine): call where the live state moved on in a way the engine did not see (an update
        by an optimizer it does not track), so that no step of it can be taken any more. The
        checkpoints already captured go on. ``reason`` ends the error's message.

        Returns:
            How many checkpoints were failed.
        """
        return self._windows.abandon_uncaptured(reason)

    def flush(self) -> None:
        """Finish the copy windows of every pending checkpoint now, at the current step.

        Call at a step boundary before code that changes parameters, buffers or optimizer state
        outside ``optimizer.step()`` (weight averaging swapping weights in through ``.data``, an
        in-place ``copy_``; ``load_state_dict`` of the whole model or an optimizer does it by
        itself, one into a submodule is taken as an edit of its step): afterwards no pending
        checkpoint reads the live tensors. A checkpoint whose captured step was not reached yet
        is captured at the current step (``state_fn`` is called now). Persisting goes on in
        the background.

        Raises:
            A background error of an earlier checkpoint.
        """
        self._flush(raise_errors=True)

    def _flush(self, *, raise_errors: bool) -> None:
        """:meth:`flush`; ``raise_errors`` as in :meth:`_step_end`."""
        self._check_process()
        self._flush_windows()
        if raise_errors:
            self._pipeline.raise_errors()

    def finish_captured(self) -> None:
        """Wait for the copies of checkpoints whose step was already taken (the last block of
        a multi-step save, copied while the loop goes on); they go on to be written.

        Call after a step boundary and before code that may change weights outside
        ``optimizer.step()`` there (a module's batch-end hook): a write into a block still being
        copied after its step was taken fails that checkpoint (it could not hold its step).
        The wait is counted as stall (seconds, ``CheckpointMetrics.stall_s``); cheap where
        nothing is being copied. The last block is the one GoCkpt §4.2 copies after the
        captured step's boundary.

        Raises:
            RuntimeError: the engine belongs to the parent of this forked process.
        """
        self._check_process()
        self._windows.finish_captured()

    def _enclosing(self, path: str | os.PathLike[str]) -> list[SaveRecord]:
        key = path_key(path)
        return [s for s in self._all if not s.handle.done()
                and key.startswith(s.handle.path.rstrip("/") + "/")]

    def enclosing_in_flight(self, path: str | os.PathLike[str]) -> list[str]:
        """The checkpoints in flight (not yet durable or failed) whose folder holds ``path``,
        spelled as their handles spell them (:func:`gockpt.fsutil.path_key`). Raises nothing."""
        return [s.handle.path for s in self._enclosing(path)]

    def finish_enclosing(self, path: str | os.PathLike[str]) -> None:
        """Before a checkpoint at ``path`` is requested (:meth:`save` calls it; a writer that
        makes its staging folder before the request calls it first): the saves in flight whose
        folder holds ``path`` (``ck`` for ``ck/sub``) are finished, captured now and waited
        for until durable or failed (a stall of this request's). Their publish puts each
        folder in place whole, which a staging folder made inside it would stop; stock's
        blocking saves write them in that order too. A failure of theirs is raised as a
        background error, later.

        Raises:
            KeyboardInterrupt and the like while waiting (the saves go on).
        """
        enclosing = self._enclosing(path)
        if not enclosing:
            return
        self._flush_windows()
        for s in enclosing:
            try:
                s.handle.outcome(None)
            except BaseException:  # noqa: BLE001 - raised by raise_errors, as any save's
                if not s.handle.done():
                    raise

    def wait(self, timeout_s: float | None = None) -> list[CheckpointMetrics]:
        """Finish every pending checkpoint now and block until all are durable.

        Blocks not yet copied are copied at the current step, which becomes their captured step.
        Call while the model and optimizers are still on their device. A checkpoint not yet
        captured fails instead (:class:`CheckpointTornError`, logged as a warning, not raised
        here) where the live state is not one step's: the run stopped inside an optimizer update
        (it raised after writing part of the state), or, called while an exception propagates
        (a ``finally``, ``__exit__``, an exception handler) or at exit after an uncaught one,
        once ``step_end`` has been called, after an update and before its ``step_end`` (an
        exception in the scheduler's step).

        Returns:
            Metrics of the checkpoints finished by this call.

        Raises:
            The first background error; TimeoutError after ``timeout_s`` seconds.
        """
        self._check_process()
        t0 = perf_counter()
        # Called while an exception propagates (a finally, __exit__, Lightning's exception
        # handler) or at exit after an uncaught one: the loop may have stopped between an
        # update and its step boundary. A loop that ends normally (a break after the
        # scheduler's step) is where its last step ended.
        self._flush_windows(at_end=_exit.stopped_by_exception())
        out = []
        deadline = None if timeout_s is None else t0 + timeout_s
        for s in list(self._all):
            left = None if deadline is None else max(0.0, deadline - perf_counter())
            try:
                out.append(s.handle.outcome(left))
            except BaseException:  # noqa: BLE001 - failures are raised once, below
                if not s.handle.done():  # this wait's own deadline, not the save's failure
                    raise
                # (A save that failed with CheckpointTimeoutError, a TimeoutError, lands here.)
        self._all = [s for s in self._all if not s.handle.done()]
        self._pipeline.raise_errors()
        return out

    def remove(self, path: str) -> None:
        """Delete the checkpoint at ``path``, cancelling an in-flight save of it first.

        No partial files of the cancelled save are left behind.

        Raises:
            OSError: the storage refused the deletion.
        """
        key = path_key(path)  # any spelling of the directory a save in flight writes
        for s in [s for s in self._all if s.path == key]:
            self._windows.cancel(s)
        for s in [s for s in self._all if s.path == key]:
            try:
                s.handle.outcome()
            except BaseException:  # noqa: BLE001 - the save was cancelled on purpose
                pass
        self._all = [s for s in self._all if not (s.path == key and s.handle.done())]
        # The checkpoint is gone when this returns (renamed aside); a large one's files are
        # deleted on a thread: unlinking them takes the kernel long enough to stall a step.
        remove_checkpoint(path, self.config.storage_options, timeout_s=self.config.storage_timeout_s,
                          discard=None if self._closed else self._deleter)

    def restore(self, path: str, *, allow_pickle: bool = False) -> Any:
        """Load a checkpoint into the live model and optimizers; returns its non-tensor state.

        Raises:
            FileNotFoundError: no complete checkpoint at ``path``.
            CheckpointCorruptError: a corrupt file (names the file and key).
            ValueError: a tensor whose shape or dtype does not fit the model (names the key),
                or optimizer state that does not fit the optimizers (another number of
                parameter groups, or of parameters in a group); nothing is loaded then.
        """
        self.wait()
        state = load_checkpoint(path, storage_options=self.config.storage_options,
                                verify=self.config.verify_on_load, allow_pickle=allow_pickle)
        load_into(self.model, self.optimizers, state)
        self.version = state.captured_step
        self._planner.updates_seen = 0  # replay waits for the loaded state or an update again
        self._planner.forget_layout()
        return state.extra

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this GoCkpt engine belongs to process {self._pid}, the parent of this forked "
                "one (its copy and persist threads are not here): build an engine in this "
                "process to checkpoint from it")

    def close(self) -> None:
        """Finish pending checkpoints, remove hooks, stop threads. In a forked child of the
        engine's process it only marks the engine closed (the parent's saves are the parent's).

        Raises:
            The first background error not raised before.
        """
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        _exit.unregister(self._exit_token)
        try:
            self.wait()
        finally:
            self._closed = True
            # Interrupted (Ctrl-C inside the wait): saves still in their windows are failed and
            # resolved before the pipeline stops, so no handle is left pending for good.
            for s in [s for s in self._windows.saves if not s.handed_off]:
                try:
                    self._windows.fail(s, CheckpointCancelledError(
                        f"{s.path}: not written: the engine was closed before its state was taken"))
                except Exception:  # noqa: BLE001 - closing goes on
                    log.exception("gockpt: could not cancel checkpoint %s", s.path)
            for h in self._hooks:
                h.remove()
            for o in self.optimizers:
                o.__dict__.pop("zero_grad", None)
            self._pipeline.close()
            self._copier.close()
            self._deleter.close()
            for claim in self._claims:
                claim.release()
        self._pipeline.raise_errors()

    def _close_at_exit(self) -> None:
        # The process is ending without close(): finish what was requested (see gockpt._exit).
        if self._closed:
            return
        log.warning("gockpt: the process is exiting with the engine open: finishing %d "
                    "checkpoint(s) in flight", sum(not s.handle.done() for s in self._all))
        try:
            self.close()
        except BaseException:  # noqa: BLE001 - nobody is left to raise to
            log.exception("gockpt: a checkpoint failed while the process was exiting")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks (training thread)

    def _claim_key(self, parent: str) -> str:
        """One key per directory this engine claims and cleans, however it is spelled: a local
        one by its path under any local protocol (a second cleanup would remove the staging
        directory of a save of its own in flight, spelled the other way)."""
        fs, local = url_to_fs(parent, self.config.storage_options)
        return os.path.realpath(local) if is_local(fs) else parent

    def _flush_windows(self, at_end: bool = False) -> None:
        """Finish the copy windows of every pending save at the current step (``at_end``: the
        run may have stopped between an update and its step boundary; see Windows.flush)."""
        self._windows.flush(self.version, at_end=at_end)

    def _on_pre_hook(self, _i: int) -> None:
        # No background error is raised here: it would skip this optimizer's update while the
        # others apply theirs (step_end, the next save, wait and close raise them).
        self._windows.update_started(self.version)
        self._windows.release_guards(wait=False)
        if not self.explicit_before_update:
            self._windows.window_end(self.version)
        elif self._windows.capture_due(self.version):
            self._windows.boundary(self.version)

    def _on_post_hook(self, opt_index: int) -> None:
        now = perf_counter()
        self.version += 1
        self._planner.updates_seen += 1
        self._windows.after_update(opt_index, self.version, now)

    def run_for(self, directory: str) -> int:
        """The run this engine's checkpoints in ``directory`` record (``meta["run"]``, ordering
        them for ``latest``: :mod:`gockpt._pointer`): its start, raised above the newest run in
        the directory at the first call (so a resumed run comes after the one it resumed, whatever
        the clocks; where the store cannot be read, a warning, and the start alone); per
        directory; a load into the live state starts a new run, after this one in every
        directory. A staging directory (a sharded part's) holds no checkpoints and is not read,
        nor is a directory without the ``latest`` pointer (``update_latest=False``: its first
        save would read every manifest there): those take the start. Training thread."""
        return self._run_for(self._claim_key(directory), directory)

    def _run_for(self, key: str, directory: str) -> int:
        """:meth:`run_for` of ``directory``, whose :meth:`_claim_key` is ``key``."""
        run = self._runs.get(key)
        if run is not None:
            return run
        if not self.config.update_latest or SCRATCH_RE.match(os.path.basename(directory.rstrip("/"))):
            return self._run_start
        try:
            newest = newest_run(directory, self.config.storage_options, self.config.storage_timeout_s)
        except Exception as e:  # noqa: BLE001 - ordering by the clock alone is the fallback
            log.warning("gockpt: could not read the newest run in %s (%s); ordering its "
                        "checkpoints by this engine's start", directory, e)
            newest = 0
        run = self._runs[key] = min(MAX_RUN, max(self._run_start, newest + 1))
        return run

    def _before_load(self) -> None:
        # What follows continues the loaded state (a rollback, a restore): a run of its own,
        # after this engine's so far in every directory (it is their one writer: no re-read).
        now = time.time_ns()
        self._run_start = max(now, self._run_start + 1)
        self._runs = {k: min(MAX_RUN, max(now, r + 1)) for k, r in self._runs.items()}
        self._windows.note_load()
        if any(not s.handed_off for s in self._windows.saves):
            self._flush_windows()

    def _before_part_load(self) -> None:
        # Not a restore: the step's own edit. The saves requested at an earlier step and still
        # to be captured take the units it writes (or replaces) live at their capture
        # (EditWatch, Windows._swapped), so their checkpoint holds the step as a blocking save
        # at its end would; captured ones still copying their last block finish that copy
        # first, which the load must not reach.
        self._windows.note_part_load()
        # A save requested at this very step holds that request's state: taken before the load,
        # as stock's blocking save at the request was.
        self._windows.flush(self.version, only=lambda s: not s.captured
                            and s.metrics.requested_step == self.version)
        self._windows.finish_captured()

    def _on_forward(self) -> None:
        self._windows.forward_start(self.version)
