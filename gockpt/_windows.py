"""The training-thread side of a save: copy windows, gradient capture and the captured step.

:class:`Windows` owns the saves still in their copy windows, the ``gockpt_o`` gradient guards
(and the ``zero_grad`` wrapper that waits for them) and the parameter versions after each update
(which tell edits outside ``optimizer.step()``). Its methods run on the training thread only,
called by the engine's public calls and its optimizer, forward and ``load_state_dict`` hooks,
with the engine's current step (``version``). A save leaves it through :meth:`Windows.finalize`
(or :meth:`Windows.fail`) into the :class:`gockpt._pipeline.Pipeline`.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._pipeline import Pipeline
from ._hooks import EngineHook
from ._record import Phase, SaveRecord, StorageLag, edited_after_capture, state_versions, unit_versions
from ._unchanged import fingerprint, rememberable, rememberable_static
from ._watch import EditWatch, ParamSampler, same_sample, state_sample
from .config import GoCkptConfig
from .errors import CheckpointTimeoutError, CheckpointTornError
from .handle import SaveHandle
from .layout import StateLayout, Unit, local, localize
from .partition import prune_model, prune_optimizer
from .plan import MULTI_STEP_MODES
from .replay import snapshot_hparams
from .snapshot import storage_key, to_skeleton
from .transfer import PRIORITY_GRAD, PRIORITY_STATE, CopyTicket, CpuCopier, CudaCopier

log = logging.getLogger("gockpt")

#: Stall phases the planner's model predicts per plan (the copy windows, the gradient and static
#: copies it charges, the waits for a gradient buffer the replay holds, a planned flush,
#: ``sync``/``async``'s copy); the rest of a save's stall (but ``setup``) is its fixed cost
#: (:meth:`Windows.fixed_stall_s`).
MODELLED_PHASES = ("window_end", "grad_copy", "grad_buffer", "static_copy", "flush", "guard",
                   "copy")

#: Per-window overhead samples the planner works from: about fifteen saves of six windows, the
#: memory of the per-save fixed cost (a copy that runs slow for a whole save is rare).
OVERHEAD_SAMPLES = 90


class CostSamples:
    """The latest ``maxlen`` values of one per-save cost, in seconds, warm saves first.

    A cold save (:attr:`gockpt._record.SaveRecord.cold`: its copies are the first into a newly
    allocated host buffer, so they also fault its pages in, and its request builds the slot's
    views) costs more than any later save into the same slot. Its value counts only until a
    save that is not cold records one; after that, cold values are not recorded.
    """

    def __init__(self, maxlen: int = 15) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=maxlen)
        self._cold = False  # every value held is a cold save's

    def add(self, value: float, *, cold: bool) -> None:
        """Record one save's value (seconds)."""
        if cold and self._values and not self._cold:
            return
        if not cold and self._cold:
            self._values.clear()
        self._cold = cold
        self._values.append(value)

    def median(self) -> float | None:
        """The median of the values held, None while there are none."""
        return statistics.median(self._values) if self._values else None

    def mean(self) -> float | None:
        """The mean of the values held, None while there are none."""
        return statistics.fmean(self._values) if self._values else None

    def values(self) -> tuple[float, ...]:
        """The values held, oldest first."""
        return tuple(self._values)

    @property
    def cold(self) -> bool:
        """Whether every value held is a cold save's (False while empty)."""
        return self._cold

    def __len__(self) -> int:
        return len(self._values)


def window_forecast(windows: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``windows`` (seconds; linear between order
    statistics, as ``numpy.quantile``'s default; the median for 0.5), the window a plan is
    sized for (:attr:`GoCkptConfig.window_quantile`). Computed here because it runs at every
    optimizer update on the training thread: 1 µs for 15 windows, ``numpy.quantile`` 60 µs.

    Raises:
        ValueError: ``windows`` is empty, or ``q`` is outside [0, 1].
    """
    if not windows:
        raise ValueError("window_forecast needs at least one window")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"window_forecast: q must be in [0, 1], got {q}")
    ordered = sorted(windows)
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


class _BufferStash:
    """Buffers as of the first step boundary, or owner's forward, after update number
    ``updates`` (Windows._stash)."""

    __slots__ = ("saves", "updates", "values")

    def __init__(self, updates: int, saves: frozenset[int]) -> None:
        self.updates = updates
        self.saves = saves  # ids of the saves requested before it
        self.values: dict[str, torch.Tensor] = {}  # entry key -> a copy, on the buffer's device


class Windows:
    """Copy windows of the saves in flight (GoCkpt §4.2), on the training thread."""

    def __init__(self, model: nn.Module, optimizers: list[Optimizer],
                 copier: CpuCopier | CudaCopier, pipeline: Pipeline,
                 config: GoCkptConfig | None = None) -> None:
        config = config or GoCkptConfig()
        self._model = model
        self._slot_wait_timeout_s = config.slot_wait_timeout_s
        # "when_changed": views a reused slot still holds unchanged are not copied again.
        self._when_changed = config.frozen_copy == "when_changed"
        self._warned_sparse = False  # the warning on sparse gradients, once per engine
        # The slot of the latest save with one of its own (weak: a dropped slot's memory goes).
        self.last_slot: weakref.ref = lambda: None  # type: ignore[assignment]
        self._optimizers = optimizers
        self._copier = copier
        self._pipeline = pipeline
        self.saves: list[SaveRecord] = []  # requested, not finalized yet
        # One copy window for planning: a quantile (the 25th percentile by default) of the latest
        # ones, so that an outlier (the replay self-check of the first save, a data-loader
        # hiccup) does not inflate the plan's windows for many steps after it, as a moving
        # average would; a low one, because it rises less in a stretch of slow steps
        # (GoCkptConfig.window_quantile, over GoCkptConfig.window_memory windows).
        self.window_s: float | None = None
        self._window_quantile = config.window_quantile
        self._recent_windows: collections.deque[float] = collections.deque(
            maxlen=config.window_memory)
        # Per-save costs no plan changes (the request's bookkeeping, taking the state tree, the
        # waits the model leaves out), in seconds, of the latest saves per mode (a multi-step
        # request also lays out gradient buffers and sizes blocks per window): added to the
        # plan's predicted stall.
        self._fixed_stalls: dict[str, CostSamples] = {}
        # Warns once when saves keep waiting for the one before to be written out.
        self.storage_lag = StorageLag()
        self._keys_cache: tuple[weakref.ref, dict[tuple, str], list] | None = None  # _tracked_keys
        # Per window, how much longer than its bytes at the planned copy rate its copy ran,
        # measured against the forecast window (seconds; may be negative), the latest windows of
        # the latest saves: what the planner charges each window (Costs.overhead_samples_s).
        self._overheads = CostSamples(maxlen=OVERHEAD_SAMPLES)
        self._t_update_end: float | None = None
        # Seconds between the first optimizer's latest updates: how far apart copy windows
        # open (step_s; the window is that less the update).
        self._recent_steps: collections.deque[float] = collections.deque(maxlen=config.window_memory)
        self._t_first_update: float | None = None
        self._fallback_warned = False
        self._pending_grads: list[tuple[CopyTicket, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._guard_handles: list = []
        self._wait_at_forward = False  # sharded gradient copies in flight: wait at the next forward
        # Parameter versions after each optimizer's latest update: a save requested after an
        # edit outside optimizer.step() (a weight swap, load_state_dict) is copied at once.
        self._updated_versions = {i: self._param_versions(i) for i in range(len(optimizers))}
        # Set for good once a parameter changed outside optimizer.step() between two updates
        # (a clamp or max-norm in a hook, a manual copy_): the loop edits weights while copy
        # windows would be open, so later saves copy at their request (Engine.save).
        self.edits_between_updates = False
        self._loaded = False  # a load_state_dict since the latest window end: not an edit
        # Optimizers that applied an update: only edits after one count (in-place init, a
        # DDP broadcast or loaded weights before the first update are not the loop's edits).
        self._updated: set[int] = set()
        # Writes between updates that bypass the version counters (``p.data.clamp_()``):
        # sampled contents, until an edit is seen.
        self._sampler = ParamSampler()
        # Where a save may take its state: the step of the latest boundary (step_end, a save's
        # request, an update's pre-hook), whether the loop marks its boundaries (step_end was
        # called: then a flush at another step is not at one), and, from an update's pre-hook
        # to its post-hook while a save still has to be captured, the version counters its
        # tensors had at that pre-hook (update_started).
        self.boundary_version = 0
        self._marked: int | None = None  # the version of the latest step_end (None: never)
        self._in_update: list[tuple[StateLayout, tuple[int, ...]]] | None = None
        # The step whose window end ran and whose update has not (a request then is late).
        self._window_ended: int | None = None
        # Buffers as they were at the first step boundary (step_end) after the latest update, or
        # in a loop without boundaries right before the first forward after it, while a save
        # requested before is still to be captured (a batch norm's running statistics move in
        # the forward): a capture at this step, after the loop has gone on into the next step's
        # forward (a stop, an exception, a flush inside an accumulation), takes them, not the
        # moved ones.
        self._updates = 0  # after_update calls: the clock of the stash
        self._stash: _BufferStash | None = None
        self._stash_hooks: dict[int, Any] = {}  # id(owner) -> its forward pre-hook handle
        self._stash_keys: dict[str, tuple[nn.Module, str]] = {}  # entry key -> (owner, name)
        self._stash_store: dict[str, torch.Tensor] = {}  # entry key -> the copy, reused

    # ------------------------------------------------------------------ request

    @property
    def marks_boundaries(self) -> bool:
        """Whether the loop marks its step boundaries (``step_end`` was called)."""
        return self._marked is not None

    def start(self, s: SaveRecord, t0: float, version: int,
              model_sd: dict[str, Any] | None = None) -> SaveHandle:
        """Queue the first copy of ``s`` (``sync``/``async``: copy, capture and hand off now).
        ``model_sd``: the model's ``state_dict(keep_vars=True)`` taken in this request, for a
        capture at this step."""
        plan, metrics, handle = s.plan, s.metrics, s.handle
        self.last_slot = weakref.ref(s.slot)
        if plan.mode in ("sync", "async"):
            self._copy_blocks(s, range(s.num_blocks), wait=True)
            self._capture(s, version, model_sd)
            s.phase = Phase.CAPTURED
            metrics.add_stall("copy", perf_counter() - t0 - metrics.stall_s - s.flushed_others_s)
            if not s.cold:
                self.storage_lag.note(metrics)
            self._note_held(s)
            if plan.mode == "sync":
                ts = perf_counter()
                self._pipeline.persist(s)
                metrics.add_stall("persist", perf_counter() - ts)
                self._pipeline.raise_errors()
                handle.result()
            else:
                handle._flush = None  # handed off: waiting for it needs no training
                self._pipeline.finalize(s)
            return handle
        self.saves.append(s)
        s.watch = EditWatch(s.layout)
        self._open_window(s)
        if s.target == version:
            self._capture(s, version, model_sd, just_opened=True)
        else:
            self._arm_stash(s.layout)
            if self._in_update is not None:  # inside an optimizer step (a hook its closure calls)
                self._in_update.append((s.layout, unit_versions(s.layout)))
        if self._window_ended == version:
            # Requested after this step's window end and before its update (a hook the closure
            # calls: Lightning's on_before_optimizer_step, gradient clipping): no window end
            # comes before that update, so this first block is copied now.
            self._end_window(s, version, None)
        metrics.add_stall("request", max(0.0, perf_counter() - t0 - metrics.stall_s
                                         - s.flushed_others_s))
        return handle

    def join(self, leader: SaveRecord, s: SaveRecord, t0: float, version: int,
             model_sd: dict[str, Any] | None = None) -> SaveHandle:
        """Start ``s``, a save sharing ``leader``'s snapshot (:class:`gockpt._record.Share`):
        its state is taken now when the leader's was (at this step), else with the leader's;
        it is handed off now when the leader was, else with it.

        Raises:
            The error of ``state_fn``, taken now (the request fails, as a save of its own would).
        """
        if leader.captured:
            current, live, _, _ = self._live(leader, model_sd)
            self._take(s, current, live, version)
        if leader.handed_off:
            self._hand_off(s)
        s.metrics.add_stall("request", max(0.0, perf_counter() - t0 - s.metrics.stall_s
                                           - s.flushed_others_s))
        return s.handle

    def drop(self, s: SaveRecord) -> None:
        """Forget ``s`` without handing it off (its request failed)."""
        if s in self.saves:
            self.saves.remove(s)
        if s is not s.share.leader:
            s.share.remove(s)
        self._disarm_stash_if_idle()

    def cancel(self, s: SaveRecord) -> None:
        """Cancel ``s``: a follower is handed off to fail as cancelled; a leader still in its
        windows too, unless a save sharing its snapshot still wants it (it keeps copying)."""
        s.cancel.set()
        leader = s.share.leader
        if s is not leader and not s.handed_off:
            self._hand_off(s)
        if leader in self.saves and not s.share.alive():
            self.finalize(leader)

    # ------------------------------------------------------------------ step events

    def after_update(self, opt_index: int, version: int, now: float) -> None:
        """Optimizer ``opt_index`` applied update ``version`` (its step post-hook, at ``now``)."""
        self._in_update = None
        self._window_ended = None
        self._updates += 1
        self._rearm_stash()
        if opt_index == 0:
            if self._t_first_update is not None:
                self._recent_steps.append(now - self._t_first_update)
            self._t_first_update = now
        self._t_update_end = now
        self._updated_versions[opt_index] = self._param_versions(opt_index)
        self._updated.add(opt_index)
        if not self.edits_between_updates:
            self._sampler.rebase(self._updated_params())
        for s in list(self.saves):
            if s.watch is not None and not s.captured:
                s.watch.rebase()  # the update's writes are not edits
            if not self._open_pending_or_fail(s):  # no boundary or update came: a misuse, as below
                continue
            if s.phase is Phase.COPYING:
                self.fail(s, CheckpointTornError(
                    f"{s.path}: an optimizer update ran while block {s.window} was being copied; "
                    "call before_update() before every update in explicit mode"))
                continue
            if s.window >= s.num_blocks - 1:
                continue
            try:
                self._capture_grads(s, opt_index)
                s.window += 1
                if (s.window == s.num_blocks - 1 and self._marked == version - 1
                        and not s.captured and s.target == version):
                    # Captured at this step's boundary, which reads the edit check back from
                    # the device (EditWatch.edited, a host sync): queued behind this window's
                    # copy, that read waited for all of it (17 ms for an 800 MB block on an
                    # H200, the copy engine serving the two in order). The copy is queued
                    # right after the capture instead; the device was still on this update.
                    # Only where the step before was marked too: a loop that marks some steps
                    # only would copy that block after the next forward, all of it a wait.
                    s.open_pending = True
                else:
                    self._open_window(s)
            except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
                self.fail(s, e)

    @property
    def step_s(self) -> float | None:
        """The median of the latest seconds between the first optimizer's updates (window and
        update; None before two updates): how far apart a save's copy windows open."""
        return window_forecast(self._recent_steps, 0.5) if self._recent_steps else None

    def edited_since_update(self, updated_only: bool = False) -> bool:
        """True if a parameter changed in place after its optimizer's latest update (or since
        the engine began, for an optimizer that applied none; ``updated_only``: those left
        out)."""
        return any(p._version != v for i, vs in self._updated_versions.items()
                   if not updated_only or i in self._updated for p, v in vs)

    def note_load(self) -> None:
        """A ``load_state_dict`` is about to overwrite live tensors (the engine's pre-hook):
        the next window end takes the versions anew instead of counting an edit."""
        self._loaded = True

    def _note_edits(self) -> None:
        """At a window end, right before an update: whether a parameter changed since the
        latest update (:attr:`edits_between_updates`): by the version counters, and for writes
        that bypass them (through ``.data``, a NumPy or DLPack alias) by sampled contents
        (:class:`gockpt._watch.ParamSampler`; on an accelerator read back a step or so later)."""
        if self.edits_between_updates:
            return
        if self._loaded:
            self._loaded = False
            self._updated_versions = {i: self._param_versions(i) for i in self._updated_versions}
            self._sampler.rebase(self._updated_params())
            return
        self._sampler.check()
        if self.edited_since_update(updated_only=True) or self._sampler.seen():
            self.edits_between_updates = True
            log.info("gockpt: parameters change outside optimizer.step() between updates; "
                     "later checkpoints are copied at their request (mode 'async')")

    def closure_end(self) -> None:
        """The closure given to an optimizer step returned, right before its update: writes made
        after the window end (hooks the closure calls after the engine's: Lightning runs the
        module's and later callbacks' ``on_before_optimizer_step`` after GoCkpt's) are noted as
        at a window end, where the update's re-base would otherwise hide them."""
        self._note_edits()
        for s in self.saves:
            if s.watch is not None and not s.captured:
                s.watch.check()

    def _updated_params(self) -> list[torch.Tensor]:
        """The parameters of the optimizers that applied an update (those edits count for)."""
        return [p for i in self._updated for p, _ in self._updated_versions[i]]

    def _param_versions(self, opt_index: int) -> list[tuple[torch.Tensor, int]]:
        return [(p, p._version) for g in self._optimizers[opt_index].param_groups for p in g["params"]]

    def capture_due(self, version: int) -> bool:
        """Whether a save takes its non-tensor state at step ``version``."""
        return any(not s.captured and s.target == version for s in self.saves)

    def step_end(self, version: int) -> None:
        """The loop's step boundary (``Engine.step_end``): :meth:`boundary`; then, the first
        time since the latest update while a save requested before is still to be captured,
        the buffers are stashed as they are here, where a blocking save of this step would
        read them (a later capture at this step, after the loop went on into the next
        forward, takes them: :meth:`_live`)."""
        if not self.marks_boundaries:
            self._unhook_owners()  # from here on the boundaries stash, not the forwards
        self._marked = version
        self._window_ended = None  # a step whose update never ran (GradScaler skipped it)
        self.boundary(version)
        if self._stash_keys and (self._stash is None or self._stash.updates != self._updates):
            self._stash_buffers()

    def boundary(self, version: int) -> None:
        """A step boundary at ``version``: saves whose captured step it is take their state."""
        self.boundary_version = version
        for s in list(self.saves):
            if not s.captured and s.target == version:
                self._try_capture(s, version)

    def window_end(self, version: int) -> None:
        """End the open copy windows (right before an update); waits for their copies."""
        now = perf_counter()
        self._note_edits()
        if self._t_update_end is not None:
            self._recent_windows.append(now - self._t_update_end)
            self.window_s = window_forecast(self._recent_windows, self._window_quantile)
        self._window_ended = version
        t_fence = perf_counter()  # the window end of every save: their margins count from it
        for s in list(self.saves):
            if not self._open_pending_or_fail(s):  # no boundary came (this step had no step_end)
                continue
            if s.phase is Phase.COPYING:
                self._end_window(s, version, t_fence)

    def _end_window(self, s: SaveRecord, version: int, t_fence: float | None) -> None:
        """End ``s``'s copy window (waits for its copies); ``t_fence``: the window end its
        margin counts from (None: not a window of the step's own, nothing learnt from it)."""
        t0 = perf_counter()
        try:
            s.tickets[s.window].fence_compute()
            t1 = perf_counter()
            self._check_window(s)
        except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
            self.fail(s, e)
            return
        s.phase = Phase.COPIED
        s.metrics.add_stall("window_end", t1 - t0)
        s.metrics.add_stall("window_check", perf_counter() - t1)
        if t_fence is not None:
            self._note_window(s, t_fence)
        if not s.captured and s.target == version:
            if not self._fallback_warned and s.num_blocks > 1:
                # stacklevel: this, window_end, Engine.before_update (or the step pre-hook),
                # its caller.
                warnings.warn("gockpt: non-tensor state taken at the next update's window end; "
                              "call engine.step_end() after each step for the exact boundary",
                              stacklevel=4)
                self._fallback_warned = True
            if not self._try_capture(s, version):
                return
        if s.window == s.num_blocks - 1:
            self.finalize(s)

    def update_started(self, version: int) -> None:
        """An optimizer's pre-hook: until its post-hook, a flush that finds a tensor of a save
        still to be captured written since now finds an update stopped midway (it raised)."""
        self.boundary_version = version  # right before an update: the state of ``version``
        layouts = {id(s.layout): s.layout for s in self.saves if not s.captured}
        # The optimizers' tensors only: a forward inside the step (a closure) moves buffers.
        self._in_update = [(layout, unit_versions(layout)) for layout in layouts.values()]

    def _not_one_step(self, version: int, at_end: bool) -> str | None:
        """Why the live state at ``version`` is not one step's (None: it is): the run stopped
        inside an update (some tensors written, others not), or, ``at_end`` (the run is being
        finished: wait, close, an exception's handler) in a loop that marks its boundaries,
        after an update and before its step boundary (an exception in the scheduler's step or
        in a later callback). A flush the loop makes while it runs (flush, remove, a request)
        is where it chose to make it."""
        if at_end and self.marks_boundaries and version != self.boundary_version:
            return (f"the run stopped after update {version} and before its step boundary "
                    "(step_end, or the next request)")
        if self._in_update is not None and any(unit_versions(lay) != v for lay, v in self._in_update):
            return "the run stopped inside an optimizer update (it raised after writing part of the state)"
        return None

    def abandon_uncaptured(self, why: str) -> int:
        """Fail every save not yet captured with :class:`CheckpointTornError` (a warning, never
        an error for the run): the live state has moved on in a way no step of it can be
        taken from. Returns how many."""
        pending = [s for s in self.saves if not s.captured]
        for s in pending:
            s.overtaken = True
            self.fail(s, CheckpointTornError(f"{s.path}: not written: {why}"))
        return len(pending)

    def flush(self, version: int, at_end: bool = False, only: Callable[[SaveRecord], bool] | None = None) -> None:
        """Finish the copy windows of every pending save at step ``version`` (``only``: of
        those it selects).

        A save not yet captured whose state the live tensors cannot give as one step's (the run
        stopped inside an update, or before its step boundary: see :meth:`_not_one_step`)
        fails with :class:`CheckpointTornError`, logged as a warning, instead of being written
        torn."""
        if only is not None:
            chosen = [s for s in self.saves if only(s)]
            if not chosen:
                return
            before = list(self.saves)
            self.saves[:] = chosen
            try:
                self.flush(version, at_end)
            finally:
                left = {id(s) for s in self.saves}  # the chosen ones flush kept (none, usually)
                self.saves[:] = [s for s in before if id(s) in left or all(s is not c for c in chosen)]
            return
        why = self._not_one_step(version, at_end)
        if why is not None:
            self.abandon_uncaptured(why)  # never a torn checkpoint, never an error for the run
        t_guards = perf_counter()
        # The wait for gradient copies in flight (gockpt_o) is the first save's flush stall:
        # its plan predicted those gradients at the flush.
        self.release_guards(wait=True)
        for i, s in enumerate(list(self.saves)):
            tf, counted = (t_guards if i == 0 else perf_counter()), s.metrics.stall_s
            try:
                self._open_pending(s)
                if s.phase is Phase.COPYING:
                    s.tickets[s.window].wait()
                    self._check_window(s)
                rest = range(s.window + 1, s.num_blocks)
                if len(rest):
                    self._copy_blocks(s, rest, wait=True)
            except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
                self.fail(s, e)
                continue
            s.phase = Phase.COPIED
            s.window = s.num_blocks - 1
            s.target = version
            s.metrics.num_overlap_steps = s.target - s.metrics.requested_step + 1
            if not s.captured and not self._try_capture(s, version):
                continue
            # Its snapshot is now the state of this step: a request at this step may share it,
            # while the tensors still hold what its capture took (a batch norm's forward since
            # moves no version counter, but the buffers' samples).
            pin = s.capture_pin
            if pin is not None and pin[0] == version and pin[1] == state_versions(s.layout) \
                    and same_sample(pin[2], state_sample(s.layout)):
                s.pinned, s.pinned_sample = (version, pin[1]), pin[2]
            # The capture inside it counts as its own phases ("capture", "static_copy").
            s.metrics.add_stall("flush", perf_counter() - tf - (s.metrics.stall_s - counted))
            self.finalize(s)

    def note_part_load(self) -> None:
        """A load into part of the model is about to write live tensors: the buffers stashed
        at this step's boundary are no longer this step's (the load belongs to it). The next
        forward of their owners stashes them again; a capture before it reads them live."""
        self.note_load()
        if self._stash is not None:
            self._stash = None
            if self._stash_keys and any(not s.captured for s in self.saves):
                self._hook_owners()

    def finish_captured(self) -> None:
        """Finish the saves already captured that still copy their last block (waits for that
        copy; such a save is then handed to the pipeline): a write about to come into the live
        tensors (a load into part of the model) is then no edit after their capture."""
        for s in list(self.saves):
            if not s.captured:
                continue
            try:
                if s.phase is Phase.COPYING:
                    t0 = perf_counter()
                    s.tickets[s.window].wait()
                    s.metrics.add_stall("window_end", perf_counter() - t0)
                    self._check_window(s)
                s.phase = Phase.COPIED
            except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
                self.fail(s, e)
                continue
            if s.window == s.num_blocks - 1:
                self.finalize(s)

    # ------------------------------------------------------------------ hand-off

    def finalize(self, s: SaveRecord) -> None:
        """Hand ``s`` to the pipeline: replay of its last gradients, then persist; with it the
        saves sharing its snapshot (after those replays: the pipeline keeps the order)."""
        if s.handed_off:  # twice would queue its persist twice
            return
        if s in self.saves:
            self.saves.remove(s)
        self._disarm_stash_if_idle()
        if s is s.share.leader and s.failed is None:
            by = s.metrics.stall_by_phase_s
            # The waits for a borrowed slot's bytes are predicted per save (predict_slot_wait_s).
            fixed = (s.metrics.stall_s - sum(by.get(name, 0.0) for name in ("setup", *MODELLED_PHASES))
                     - s.drain_wait_s)
            self._fixed_stalls.setdefault(s.plan.mode, CostSamples()).add(fixed, cold=s.cold)
            if not s.cold:
                self.storage_lag.note(s.metrics)  # its request's slot wait and its windows'
        self._hand_off(s)
        if s is not s.share.leader:
            return
        for r in s.share.records[1:]:
            if r.handed_off:
                continue
            if not r.captured and r.failed is None and not r.cancel.is_set():  # never expected
                r.failed = RuntimeError(f"{r.path}: its state was not taken with its snapshot's")
                r.cancel.set()
            self._hand_off(r)

    def fixed_stall_s(self, mode: str) -> float:
        """The per-save fixed cost of a save in ``mode``, seconds: its stall less what the stall
        model predicts per plan (the phases in :data:`MODELLED_PHASES`) and less one-time setup,
        i.e. the request and capture on the training thread and the short waits the model
        leaves out (version checks, a borrowed slot), the mean over the
        latest saves in that mode, else the median of the other modes' means; warm saves'
        before cold ones' (:class:`CostSamples`: a cold save pays more than a mode's difference);
        0.0 before any save. A mean, not a median: this cost is skewed (a save whose request
        meets a busy second core takes twice the usual), and the prediction it enters is of the
        mean stall."""
        own = self._fixed_stalls.get(mode)
        for cold in (False, True):
            if own is not None and len(own) and own.cold == cold:
                return own.mean() or 0.0
            others = [x.mean() for x in self._fixed_stalls.values() if len(x) and x.cold == cold]
            if others:
                return statistics.median(others)
        return 0.0

    @property
    def overhead_samples_s(self) -> tuple[float, ...]:
        """How much longer than its bytes at the planned copy rate each of the latest windows'
        copy ran, counted against the forecast window, seconds (:meth:`_note_window`; empty
        before any warm save, and where the host cannot see when a copy ended: CUDA)
        (:attr:`gockpt.plan.Costs.overhead_samples_s`)."""
        return self._overheads.values()

    def _note_window(self, s: SaveRecord, t_fence: float) -> None:
        """Record the margin and the overhead of ``s``'s window that ends at ``t_fence``.

        The window's copy (its state block and, for ``gockpt_o``, the gradients queued as it
        opened, where the model counts them in the window) ended ``margin = t_fence - done``
        before the window end (negative: the training thread waited). Its copy at the planned rate takes ``load`` seconds, so the window
        could have carried ``load + margin`` seconds of copy; against the forecast window
        ``window_s`` that is an overhead of ``window_s - load - margin``. Measured this way, not
        inverted from the stall, a window with room to spare still says how much room it had.
        """
        # The gradients queued as the window opened ride in it under gockpt_o, except in the
        # last window of a plan that pays them (static tensors, copied behind them when the
        # state is taken as that window opens: the model's paid part, plan.paid_s).
        last_paid = s.window == s.num_blocks - 1 and s.plan.paid_s > 0
        carried = s.plan.mode == "gockpt_o" and not last_paid
        tickets = [s.tickets[s.window], *(s.window_grads if carried else ())]
        done = [t.done_at for t in tickets]
        nbytes = sum(t.nbytes for t in tickets)
        if None in done:  # CUDA: the host did not see the copy end
            return
        margin = t_fence - max(done)  # type: ignore[type-var]
        s.metrics.window_margins_s.append(margin)
        bw, w = s.plan.copy_bytes_per_s, self.window_s
        if not s.plan.costed or bw <= 0 or nbytes == 0 or w is None or s.cold:
            # No rate to count the copy at, or nothing copied: no overhead seen. A cold save's
            # copies also fault in the pages of its new host buffers, which no later save into
            # them pays (the LoRA benchmark's first warm save was predicted 3x its stall).
            return
        self._overheads.add(w - nbytes / bw - margin, cold=False)

    def _note_held(self, s: SaveRecord) -> None:
        """Before ``s`` goes to the pipeline (training thread, which alone reads ``held``): the
        held entries of each of its shards that holds only tensors copied by an earlier save."""
        if not self._when_changed or s.writer is not None or s.shard_segments is not None:
            return
        held, out = s.slot.held, {}
        for i, (sh, base) in enumerate(zip(s.shards, s.shard_bases, strict=True)):
            got = held.entries(base + b for b, _ in sh.offsets.values()) if sh.offsets else None
            if got is not None:
                out[i] = got
        s.held_entries = out

    def _hand_off(self, s: SaveRecord) -> None:
        s.watch = None  # its last check ran at its last window end
        self._note_held(s)
        s.phase = Phase.FINALIZED
        s.handle._flush = None  # waiting for it now needs no training: no flush of the others
        self._pipeline.finalize(s)

    def fail(self, s: SaveRecord, e: BaseException) -> None:
        """Fail ``s`` with ``e``, and the saves sharing its snapshot that are not handed off (the
        copies failed); the persist reports it (raised at a later hook or call)."""
        s.failed = e
        s.cancel.set()
        s.watch = None
        if s is s.share.leader:
            for r in s.share.records[1:]:
                if not r.handed_off:
                    r.failed, r.overtaken = r.failed or e, s.overtaken
                    r.cancel.set()
        self.finalize(s)

    def _fail_own(self, r: SaveRecord, e: BaseException) -> None:
        """``r``'s own part failed (its ``state_fn``); the others sharing its snapshot go on (a
        leader keeps driving the copies for them; its persist reports the error)."""
        r.failed = e
        r.cancel.set()
        if r is not r.share.leader and not r.handed_off:
            self._hand_off(r)

    # ------------------------------------------------------------------ copies

    def _open_window(self, s: SaveRecord) -> None:
        # The gradient copies queued since the last window opened overlap this one (gockpt_o).
        s.window_grads, s.grads_seen = s.grad_tickets[s.grads_seen:], len(s.grad_tickets)
        if s.watch is not None:  # None: opened after the capture, which guards it (_guard_block)
            s.watch.add(s.plan.blocks[s.window])  # from the start of its copy
        self._copy_blocks(s, [s.window], wait=False)
        s.phase = Phase.COPYING

    def _open_pending(self, s: SaveRecord) -> None:
        """Open ``s``'s last window if :meth:`after_update` left it for the capture."""
        if s.open_pending:
            s.open_pending = False
            self._open_window(s)

    def _open_pending_or_fail(self, s: SaveRecord) -> bool:
        """:meth:`_open_pending`; False, ``s`` failed, where that raised (its slot wait)."""
        try:
            self._open_pending(s)
        except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
            self.fail(s, e)
            return False
        return True

    def _copy_blocks(self, s: SaveRecord, blocks: Sequence[int] | range, wait: bool) -> None:
        pairs = []
        s.versions = []
        s.to_remember = []
        held = s.slot.held if self._when_changed else None
        base = s.slot.data.data_ptr()
        for j in blocks:
            for i in s.plan.blocks[j]:
                u = s.layout.units[i]
                keep = held is not None and rememberable(u)
                for e in u.entries:
                    view = s.views[e.key]
                    s.versions.append((e.versioned, e.versioned._version))
                    if held is not None:
                        off = view.data_ptr() - base
                        if keep and held.holds(off, e.versioned, e.tensor):
                            s.metrics.unchanged_bytes += e.spec.nbytes
                            continue
                        held.forget((off,))
                        if keep:
                            s.to_remember.append((off, e.spec.nbytes, fingerprint(e.versioned, e.tensor)))
                    pairs.append((e.tensor, view))
        if s.borrowed is not None and not s.borrowed.done:
            self._wait_drain(s, [v for _, v in pairs])
        nbytes = sum(d.numel() * d.element_size() for _, d in pairs)
        s.metrics.state_bytes += nbytes
        ticket = self._copier.copy(pairs, PRIORITY_STATE)
        for j in blocks:
            s.tickets[j] = ticket
        if wait:
            ticket.wait()
            self._check_versions(s)

    def _wait_drain(self, s: SaveRecord, views: list[torch.Tensor]) -> None:
        """Wait until the save ``s`` borrowed its slot from has written out the bytes of
        ``views`` (counted as ``slot_wait``).

        Raises:
            CheckpointTimeoutError: the save's slot waits, together, passed
                ``slot_wait_timeout_s``; ``s`` is then dropped with a warning, not an error
                (the checkpoints before it stand).
        """
        base = s.slot.data.data_ptr()
        ranges = [(v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size()) for v in views]
        t0 = perf_counter()
        left = self._slot_wait_timeout_s
        if left is not None:  # one bound for all of the save's slot waits, the request's included
            left = max(0.0, left - s.metrics.stall_by_phase_s.get("slot_wait", 0.0))
        ok = s.borrowed.wait_free(ranges, left)  # type: ignore[union-attr]
        waited = perf_counter() - t0
        s.metrics.add_stall("slot_wait", waited)
        s.drain_wait_s += waited
        if not ok:
            s.overtaken = True
            raise CheckpointTimeoutError(
                f"{s.path}: the checkpoint before it was not written out within "
                "slot_wait_timeout_s; this checkpoint is skipped (storage slower than the "
                "checkpoint interval?)")

    def _check_window(self, s: SaveRecord) -> None:
        """At the end of ``s``'s open window (its copy done): before the step is taken, note the
        writes outside an update to every block copied so far (:class:`EditWatch`: those units
        are copied live at the capture); after it (the last window, whose copy began before the
        step was taken), fail ``s`` when its block was written since the capture.

        Raises:
            CheckpointTornError: a tensor of the block copied in the open window changed after
                the step was taken (``s`` cannot hold it; the previous checkpoints stand).
        """
        w = s.watch
        if not s.captured:
            w.check()
        elif w is not None:
            w.check()
            # On a CUDA device the sampled comparison is read by the persist before it writes
            # (no host sync here, behind the copy this window end fenced).
            s.late_edits = w.sampled_later() or None
            if w.edited(host_only=True):  # the counters, and the samples not on a CUDA device
                s.overtaken = True
                self.edits_between_updates = True  # later saves are copied at their request
                raise CheckpointTornError(edited_after_capture(s.path))
        self._remember_copied(s)

    def _settle_edits(self, s: SaveRecord, check: bool = True) -> None:
        """At ``s``'s capture: the units written outside an update since their copy began go
        into :attr:`SaveRecord.edited` (copied live with the state tree). If some were, or the
        loop is known to edit between updates, the block still being copied is waited for, so
        that an edit after the capture cannot reach it; else it is watched until its window
        ends (:meth:`_check_window`)."""
        w = s.watch
        if check:  # else the capture follows the window's opening in one call: nothing ran
            w.check()
            s.edited = w.edited()
        s.watch = None
        if not check and not s.edited and not self.edits_between_updates \
                and s.phase is Phase.COPYING:
            # Its watch covers just the block being copied, from before its copy: it guards
            # that block as a new one would (_guard_block), without taking its samples again.
            s.watch = w
            return
        if s.edited:
            stale = _unit_offsets(s, s.edited)
            s.slot.held.forget(stale)
            s.to_remember = [r for r in s.to_remember if r[0] not in stale]
            self.edits_between_updates = True  # later saves are copied at their request
            log.info("gockpt: %s: %d parameter(s) changed outside optimizer.step() during its "
                     "copy windows: copied at the captured step", s.path, len(s.edited))
        if s.phase is Phase.COPYING:
            self._guard_block(s)

    def _guard_block(self, s: SaveRecord) -> None:
        """After ``s``'s capture, the block still being copied: waited for if the loop edits
        outside updates (an edit after the capture must not reach it), else watched until its
        window ends (:meth:`_check_window`)."""
        if s.edited or self.edits_between_updates:
            t0 = perf_counter()
            s.tickets[s.window].wait()
            s.metrics.add_stall("window_end", perf_counter() - t0)
            return
        s.watch = EditWatch(s.layout)
        s.watch.add([i for i in s.plan.blocks[s.window] if i not in s.edited])

    def _check_versions(self, s: SaveRecord) -> None:
        """Fail ``s`` (CheckpointTornError) when a tensor changed while it was copied; else the
        views just copied that no replay writes are remembered in the slot."""
        for t, v in s.versions:
            if t._version != v:
                # Not an engine fault: code outside optimizer.step() edited the state after the
                # request. This save cannot hold the requested state; training goes on.
                s.overtaken = True
                raise CheckpointTornError(
                    f"{s.path}: a tensor changed while it was copied (edited outside "
                    "optimizer.step() after the save was requested); this checkpoint is not "
                    "written. Call engine.flush() before such edits, or save with mode='async'")
        self._remember_copied(s)

    @staticmethod
    def _remember_copied(s: SaveRecord) -> None:
        """The views just copied that no replay writes are remembered in the slot."""
        for off, nbytes, fp in s.to_remember:
            s.slot.held.remember(off, nbytes, fp)
        s.to_remember = []

    def _capture_grads(self, s: SaveRecord, opt_index: int) -> None:
        """Copy the gradients of the update just applied for blocks 0..window (GoCkpt §4.2.2)."""
        opt = self._optimizers[opt_index]
        units = [
            i for j in range(s.window + 1) for i in s.plan.blocks[j]
            if s.layout.units[i].optimizer_index == opt_index and s.layout.units[i].param.grad is not None
            and not (not s.layout.units[i].state_entries and opt.state.get(s.layout.units[i].param))
        ]
        sparse = [i for i in units if i not in s.live_units
                  and local(s.layout.units[i].param.grad).layout != torch.strided]
        if sparse:
            self._take_live(s, sparse)
        units = [i for i in units if i not in s.live_units]
        if self._when_changed and units:
            # The replay will write these views: a frozen parameter unfrozen during the save,
            # whose view was kept (not copied, so not waited for on a borrowed slot).
            s.slot.held.forget(_unit_offsets(s, units))
            if s.borrowed is not None and not s.borrowed.done:
                self._wait_drain(s, [s.views[e.key] for i in units for e in s.layout.units[i].entries])
        turn = s.grad_turn
        s.grad_turn ^= 1
        t0 = perf_counter()
        s.slot.grad_busy[turn].wait()  # the replay of the update before last has released it
        s.metrics.add_stall("grad_buffer", perf_counter() - t0)
        s.slot.grad_busy[turn].clear()
        queued: list[CopyTicket] = []
        try:
            self._copy_grads(s, opt_index, units, turn, queued)  # its last call queues the replay
        except BaseException:
            # No replay will release the buffer: a later capture would wait for it forever. A
            # copy already queued into it ends first.
            for t in queued:
                try:
                    t.wait()
                except Exception:  # noqa: BLE001 - it only had to end
                    pass
            s.slot.grad_busy[turn].set()
            raise

    def _take_live(self, s: SaveRecord, units: list[int]) -> None:
        """``units`` got gradients no dense host buffer holds (sparse): no replay brings their
        host copies forward, so ``s`` takes them live at its capture, on the training thread
        (:attr:`SaveRecord.live_units`)."""
        s.live_units.update(units)
        s.slot.held.forget(_unit_offsets(s, units))
        if not self._warned_sparse:
            self._warned_sparse = True
            names = ", ".join(s.layout.units[i].param_entry.key for i in units[:3])
            log.warning("gockpt: %s get sparse gradients: multi-step checkpoints copy them on the "
                        "training thread at the captured step (mode 'lazy' copies them with the "
                        "rest)", names)

    def _copy_grads(self, s: SaveRecord, opt_index: int, units: list[int], turn: int,
                    queued: list[CopyTicket]) -> None:
        """Queue the copy of ``units``' gradients into gradient buffer ``turn`` (its ticket
        appended to ``queued``) and their replay."""
        opt = self._optimizers[opt_index]
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = [
            (local(s.layout.units[i].param.grad), s.grad_views[turn][i])  # type: ignore[arg-type]
            for i in units
        ]
        hparams = [snapshot_hparams(g) for g in opt.param_groups]
        # GradScaler steps an optimizer with its own scaling (fused Adam, AdamW, SGD, Adagrad:
        # ``_step_supports_amp_scaling``) even when the gradients hold an inf or a NaN; the
        # kernel then leaves parameters and state as they were, reading ``found_inf`` on the
        # device. Its value goes with the gradients, and the replay skips such an update.
        found_inf = getattr(opt, "found_inf", None)
        skip = None
        if isinstance(found_inf, torch.Tensor):
            skip = torch.empty(found_inf.shape, dtype=found_inf.dtype,
                               pin_memory=found_inf.is_cuda)
            pairs = pairs + [(found_inf.detach(), skip)]
        ticket = self._copier.copy(pairs, PRIORITY_GRAD, check_versions=True)
        queued.append(ticket)
        s.grad_tickets.append(ticket)
        s.metrics.grad_bytes += ticket.nbytes - (0 if skip is None else skip.nbytes)
        if s.plan.mode == "gockpt":
            t0 = perf_counter()
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - the copy's error fails its save (the replay raises it), not this update
                pass
            s.metrics.add_stall("grad_copy", perf_counter() - t0)
        elif s.layout.sharded:
            # FSDP2 accumulates into sharded gradients outside autograd, where no tensor hook
            # fires: the copy overlaps only until the next forward starts (forward_start).
            self._pending_grads.append((ticket, pairs))
            self._wait_at_forward = True
        else:
            self._guard(ticket, pairs)
        self._pipeline.submit_replay(s, (opt_index, type(opt), hparams, units, turn, skip), ticket)

    # ------------------------------------------------------------------ gockpt_o guards

    def _guard(self, ticket: CopyTicket, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # gockpt_o (§4.2.4): the copy overlaps the next forward; the next backward must not
        # accumulate into a gradient still being read. A tensor hook on each parameter fires
        # before accumulation, so it waits there when the same gradient tensor is still live.
        self._pending_grads.append((ticket, pairs))
        by_grad = {id(g) for g, _ in pairs}
        # Gradients that are views into a buffer (DDP's gradient_as_bucket_view; a bucket may
        # hold one large parameter alone, then the view is the whole buffer) get
        # written by the next backward even after zero_grad(set_to_none=True) (the reducer
        # puts the bucket back as .grad), and a write for any parameter of that buffer moves
        # the version counter the copy is checked against: every parameter whose gradient
        # shares such a buffer is guarded, and stays guarded when its gradient is set to None.
        buffers = {g.untyped_storage().data_ptr() for g, _ in pairs
                   if g._base is not None or g.untyped_storage().nbytes() > g.nbytes}
        for o in self._optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    if p.grad is None or not p.requires_grad:
                        continue
                    g = local(p.grad)
                    if g.layout != torch.strided:
                        continue  # sparse: never copied (taken live at the capture), no storage
                    shared = bool(buffers) and g.untyped_storage().data_ptr() in buffers
                    if shared or id(g) in by_grad:
                        self._guard_handles.append(
                            (p, p.register_hook(self._guard_hook(p, ticket, shared)), shared))

    def _guard_hook(self, p: torch.Tensor, ticket: CopyTicket, shared: bool):
        pid = os.getpid()

        def hook(grad: torch.Tensor) -> None:
            # A gradient set to None is not written into again, unless its buffer is shared.
            # (Not in a forked child: no copy thread there ends the ticket.)
            if (shared or p.grad is not None) and not ticket.done() and os.getpid() == pid:
                t0 = perf_counter()
                try:
                    ticket.wait()
                except Exception:  # noqa: BLE001 - the copy's error fails its save (replay), not this backward
                    pass
                for s in self.saves:
                    s.metrics.add_stall("guard", (perf_counter() - t0) / max(1, len(self.saves)))
        return hook

    def forward_start(self, version: int) -> None:
        """The model's forward begins: guarded sharded gradient copies end; a due capture (in a
        loop that marks its step boundaries, only once the step's boundary has passed)."""
        if self._wait_at_forward:
            self._wait_at_forward = False
            t0 = perf_counter()
            self.release_guards(wait=True)
            for s in self.saves:
                s.metrics.add_stall("guard", (perf_counter() - t0) / max(1, len(self.saves)))
        # In a loop that marks its step boundaries, a forward between an update and its
        # boundary (a callback's forward at the batch end) is not one: the capture waits.
        if self.saves and self.capture_due(version) and (
                not self.marks_boundaries or self.boundary_version == version):
            self.boundary(version)
        for s in list(self.saves):
            # A forward before the boundary (a callback's at the batch end): the last block's
            # copy overlaps it and the next ones, as the capture will wait anyway.
            self._open_pending_or_fail(s)

    def release_guards(self, wait: bool) -> None:
        """Drop the gradient guards whose copies ended (``wait``: wait for all of them first)."""
        if not self._pending_grads:
            return
        if wait:
            for t, _ in self._pending_grads:
                try:
                    t.wait()
                except Exception:  # noqa: BLE001 - a torn copy fails its save (replay), not the loop
                    pass
        if all(t.done() for t, _ in self._pending_grads):
            self._pending_grads.clear()
            for _, h, _ in self._guard_handles:
                h.remove()
            self._guard_handles.clear()

    def drop_cleared_guards(self) -> None:
        """Remove the guards of parameters whose gradient is now None (``zero_grad`` with
        ``set_to_none=True``): their next backward makes a new gradient tensor and cannot
        write into one still being copied, so the hook would only cost a call into Python, with
        the GIL, inside that backward. The copies themselves are still waited for where needed
        (``release_guards``, the version check of each gradient copy)."""
        if not self._guard_handles:
            return
        kept = []
        for p, h, shared in self._guard_handles:
            if p.grad is None and not shared:
                h.remove()
            else:
                kept.append((p, h, shared))
        self._guard_handles = kept

    def wrap_zero_grad(self, opt: Optimizer) -> None:
        """Make ``opt.zero_grad(set_to_none=False)`` wait for the guarded gradient copies."""
        # An in-place zero_grad(set_to_none=False) would overwrite gradients still being copied
        # in gockpt_o mode; wait for those copies first.
        original = opt.zero_grad
        pid = os.getpid()

        def zero_grad(set_to_none: bool = True) -> None:
            if os.getpid() != pid:  # a forked child: the copies are the parent's
                return original(set_to_none=set_to_none)
            if not set_to_none:
                self.release_guards(wait=True)
            original(set_to_none=set_to_none)
            if set_to_none:
                self.drop_cleared_guards()

        opt.zero_grad = zero_grad  # type: ignore[method-assign]

    # ------------------------------------------------------------------ capture

    def _try_capture(self, s: SaveRecord, version: int) -> bool:
        try:
            self._capture(s, version)
        except BaseException as e:  # noqa: BLE001 - fails this checkpoint; raised at the next hook
            self.fail(s, e)
            return False
        return True

    def _capture(self, s: SaveRecord, version: int, model_sd: dict[str, Any] | None = None,
                 just_opened: bool = False) -> None:
        """Take the state tree, buffers and param groups at the captured step ``version``.

        The tree (``state_fn()``, the model's state_dict, the optimizers' state_dicts) is copied
        at once with :func:`gockpt.snapshot.to_skeleton`: a tensor that is a tracked tensor of
        this save becomes a reference to its shard entry, any other tensor (a hook's edit,
        optimizer state created inside the copy window) is copied to the CPU now, except the
        tensors another rank stores when the write is shared (:mod:`gockpt.partition`). Units whose
        optimizer state appeared or was replaced during the windows are not referenced: their
        host copies were not brought forward, so their live values are copied here instead.
        Every save sharing ``s``'s snapshot takes its own tree now too; one whose ``state_fn``
        raises fails alone while others still want the snapshot.
        """
        t0 = perf_counter()
        if s.watch is not None and not s.captured:
            self._settle_edits(s, check=not just_opened)
        current, live, pairs, stashed = self._live(s, model_sd)
        remember = []
        if self._when_changed and pairs:
            pairs, remember = self._unchanged_static(s, pairs)
        pairs = [(t.detach(), view) for t, view in pairs]
        if pairs:
            tc = perf_counter()
            t = self._copier.copy(pairs, PRIORITY_GRAD)
            t.wait()
            for off, nbytes, fp in remember:
                s.slot.held.remember(off, nbytes, fp)
            s.metrics.state_bytes += t.nbytes
            # Apart from "capture": the planner predicts this copy, the rest is a fixed cost.
            s.metrics.add_stall("static_copy", perf_counter() - tc)
            t0 += perf_counter() - tc
        others = [r for r in s.share.records if r is not s and not r.cancel.is_set()]
        for r in [s, *others] if not s.cancel.is_set() else others:
            if r.captured or (r is not s and r.handed_off):
                continue
            try:
                self._take(r, current, live, version)
            except BaseException as e:  # noqa: BLE001 - raised when s is alone
                if r is s and not others:
                    raise
                self._fail_own(r, e)
        s.captured = True
        # Buffers taken from before a forward since: the live tensors no longer hold this
        # snapshot, so no later request at this step may share it.
        s.capture_pin = None if stashed else (version, state_versions(s.layout), state_sample(s.layout))
        s.metrics.add_stall("capture", perf_counter() - t0)
        self._disarm_stash_if_idle()
        if s.open_pending:
            # The last block's copy, queued behind everything the capture read from the device
            # (the edit check, the buffers, the state tree's tensors), none of which waits for it.
            self._open_pending(s)
            self._guard_block(s)

    def _unchanged_static(self, s: SaveRecord, pairs: list) -> tuple[list, list]:
        """``pairs`` (static tensor, view) less those the slot still holds unchanged, and what
        to remember once the rest are copied (frozen parameters only). Nothing but this copy
        writes a static view."""
        held, base = s.slot.held, s.slot.data.data_ptr()
        todo, remember = [], []
        for t, view in pairs:
            off = view.data_ptr() - base
            nbytes = view.numel() * view.element_size()
            keep = rememberable_static(t)
            if keep and held.holds(off, t, t):
                s.metrics.unchanged_bytes += nbytes
                continue
            held.forget((off,))
            todo.append((t, view))
            if keep:
                remember.append((off, nbytes, fingerprint(t, t)))
        return todo, remember

    def _live(self, s: SaveRecord, model_sd: dict[str, Any] | None = None,
              ) -> tuple[dict, dict[tuple, str], list, bool]:
        """The model's state_dict as ``s`` stores it, the tracked tensors that the state tree may
        reference (storage key -> entry key), the (buffer, host view) copies to make, and
        whether a buffer comes from the stash (its value before a forward since this step's
        update, :meth:`_stash_buffers`). ``model_sd``: the model's ``state_dict(keep_vars=True)``
        already taken at this step, in the same request (nothing runs between that could
        change it)."""
        # One traversal of the module tree serves both the state tree and the buffers.
        current = self._model.state_dict(keep_vars=True) if model_sd is None else model_sd
        if s.layout.sharded:  # DTensors: their local shards are what this rank stores
            current = localize(current)  # type: ignore[assignment]
        part = s.layout.partition  # a shared write: other ranks' tensors are in their parts
        if part is not None:
            current = prune_model(current, part)
        live, stored = self._tracked_keys(s.layout)
        live = dict(live)
        replaced = []
        for i, (u, keys) in enumerate(zip(s.layout.units, stored)):
            # rare: written or replaced during the windows, or given a sparse gradient
            if i in s.edited or i in s.live_units or self._dirty(u, keys) \
                    or self._swapped(u, keys, current):
                live.pop(keys[0], None)
                for k in keys[1].values():
                    live.pop(k, None)
                if i not in s.edited and i not in s.live_units:
                    replaced.append(i)
        if replaced:
            # Their live values go into the slot views too (_sync_edited): views a writer builds
            # files from must not keep the copies of the tensors the model no longer holds.
            s.live_units |= set(replaced)
            s.slot.held.forget(_unit_offsets(s, replaced))
        pairs = []
        st = self._stash
        stash = st.values if st is not None and st.updates == self._updates and id(s) in st.saves else {}
        stashed = False
        if s.layout.static:
            # Re-read: a forward may rebind a buffer (``self.count = self.count + 1``).
            for e in s.layout.static:
                t = current.get(e.key[len("model."):]) if e.key.startswith("model.") else e.tensor
                if not isinstance(t, torch.Tensor) or t.dtype != e.spec.dtype \
                        or tuple(t.shape) != e.spec.shape:
                    # Removed, or replaced by another shape or dtype (pruning made permanent, a
                    # cast) during the windows: its slot view is left unused, and the state tree
                    # holds what is there now (copied as an untracked tensor), or nothing.
                    continue
                before = stash.get(e.key)
                if before is not None and before.dtype == t.dtype and before.shape == t.shape:
                    pairs.append((before, s.views[e.key]))
                    stashed = True
                else:
                    pairs.append((t, s.views[e.key]))
                live[storage_key(t)] = e.key
        return current, live, pairs, stashed

    # ------------------------------------------------------------------ buffer stash

    def _arm_stash(self, layout: StateLayout) -> None:
        """Note the buffers of ``layout`` (a save still to be captured) for the stash. In a loop
        that marks its step boundaries, the first boundary after each update stashes them
        (:meth:`step_end`); in one that does not, the first forward of a module owning one
        after each update does, before any of them moved (hooks on those modules)."""
        for e in layout.static:
            if not e.key.startswith("model.") or isinstance(e.tensor, nn.Parameter):
                continue  # frozen parameters do not move in a forward
            owner, _, name = e.key[len("model."):].rpartition(".")
            if e.key in self._stash_keys:
                continue
            try:
                module = self._model.get_submodule(owner)
            except AttributeError:  # a wrapped model's key: taken live, as before
                continue
            self._stash_keys[e.key] = (module, name)
        if not self.marks_boundaries and (self._stash is None or self._stash.updates != self._updates):
            self._hook_owners()

    def _hook_owners(self) -> None:
        for module, _ in self._stash_keys.values():
            if id(module) not in self._stash_hooks:
                self._stash_hooks[id(module)] = module.register_forward_pre_hook(EngineHook(self._stash_buffers))

    def _unhook_owners(self) -> None:
        # Unhooked between the stash and the next update: their forwards take torch's path
        # without hooks, and the hooks cost one registration per owner and update.
        for h in self._stash_hooks.values():
            h.remove()
        self._stash_hooks.clear()

    def _rearm_stash(self) -> None:
        """After an update: in a loop without step boundaries, hook the owners again while a
        save is still to be captured (their first forward stashes the buffers); with them,
        the next boundary does (:meth:`step_end`)."""
        self._stash = None
        if self._stash_keys:
            if not any(not s.captured for s in self.saves):
                self._disarm_stash_if_idle()
            elif not self.marks_boundaries:
                self._hook_owners()

    def _disarm_stash_if_idle(self) -> None:
        if self._stash_keys and not any(not s.captured for s in self.saves):
            self._unhook_owners()
            self._stash_keys.clear()
            self._stash = None
            self._stash_store.clear()

    def _stash_buffers(self) -> None:
        """The first step boundary, or forward of a module owning buffers, since the latest
        update: copy every noted buffer (one batched copy into tensors kept from the last
        time), for the saves requested before it and still to be captured; then the hooks go
        until the next update."""
        if self._stash is not None and self._stash.updates == self._updates:
            self._unhook_owners()
            return
        saves = frozenset(id(s) for s in self.saves if not s.captured)
        if not saves:
            self._unhook_owners()
            return
        st = self._stash = _BufferStash(self._updates, saves)
        srcs, dsts = [], []
        for key, (module, name) in self._stash_keys.items():
            t = getattr(module, name, None)
            if not isinstance(t, torch.Tensor):
                continue
            t = t.detach()
            kept = self._stash_store.get(key)
            if kept is None or kept.dtype != t.dtype or kept.shape != t.shape or kept.device != t.device:
                kept = self._stash_store[key] = torch.empty_like(t)
            srcs.append(t)
            dsts.append(kept)
            st.values[key] = kept
        if srcs:
            torch._foreach_copy_(dsts, srcs)
        self._unhook_owners()

    def _take(self, r: SaveRecord, current: dict, live: dict[tuple, str], version: int) -> None:
        """``r``'s own state tree at step ``version`` (its ``state_fn``), over ``_live``'s parts."""
        # The skeleton owns copies of everything that is not a reference, so it is serialized
        # later on the persist thread.
        r.extra = {
            "user": to_skeleton(r.state_fn(), live, keep_params=True) if r.state_fn is not None else None,
            "optimizers": [to_skeleton(self._optimizer_state(r, i), live)
                           for i in range(len(self._optimizers))],
            "model": to_skeleton(current, live),
        }
        r.metrics.captured_step = version
        if r is not r.share.leader:
            r.captured, r.target = True, version
            r.metrics.num_overlap_steps = version - r.metrics.requested_step + 1

    def _optimizer_state(self, s: SaveRecord, i: int) -> dict:
        """Optimizer ``i``'s state_dict as this rank stores it (local shards; its own units)."""
        sd = self._optimizers[i].state_dict()
        if s.layout.sharded:
            return localize(sd)  # type: ignore[return-value]
        part = s.layout.partition
        return sd if part is None else prune_optimizer(sd, i, part)

    def _tracked_keys(self, layout: StateLayout) -> tuple[dict[tuple, str], list]:
        """The :func:`gockpt.snapshot.storage_key` of every unit's tensors in ``layout``: (key ->
        entry key over all units, per unit (its parameter's key, state name -> key)). Made once
        per layout, since taking 3 keys per parameter at every capture cost more than the rest
        of ``_live``. An entry's tensor is an alias only the layout holds, so its shape and
        strides cannot change; its address changes only if its storage is resized in place
        (``untyped_storage().resize_()``), which tracked tensors must not be between two step
        boundaries (the layout check at the next request sees it and builds a new layout)."""
        cached = self._keys_cache
        if cached is None or cached[0]() is not layout:
            live: dict[tuple, str] = {}
            stored = []
            for u in layout.units:
                pk = storage_key(u.param_entry.tensor)
                live[pk] = u.param_entry.key
                sk = {}
                for n, e in u.state_entries.items():
                    sk[n] = storage_key(e.tensor)
                    live[sk[n]] = e.key
                stored.append((pk, sk))
            # A weak reference: the keys hold no tensor, and a replaced layout's tensors (old
            # optimizer state after load_state_dict) must not outlive it here.
            cached = self._keys_cache = (weakref.ref(layout), live, stored)
        return cached[1], cached[2]

    @staticmethod
    def _swapped(u: Unit, keys: tuple[tuple, dict[str, tuple]], current: dict[str, Any]) -> bool:
        """Whether the model's state_dict (``current``) holds another tensor than ``u``'s under
        its key: a parameter replaced by a new object during the windows (``load_state_dict(...,
        assign=True)``, an attribute set); the unit's host copy is of the one it replaced."""
        key = u.param_entry.key
        if not key.startswith("model."):
            return False
        t = current.get(key[len("model."):])
        return isinstance(t, torch.Tensor) and storage_key(t) != keys[0]

    def _dirty(self, u: Unit, keys: tuple[tuple, dict[str, tuple]]) -> bool:
        """Whether ``u``'s optimizer state is no longer the tensors its host copy was taken from
        (``keys``: its entry from :meth:`_tracked_keys`)."""
        stored = keys[1]
        n = 0
        for name, t in self._optimizers[u.optimizer_index].state.get(u.param, {}).items():
            if isinstance(t, torch.Tensor):
                n += 1
                if stored.get(name) != storage_key(local(t)):
                    return True
        return n != len(stored)


def _unit_offsets(s: SaveRecord, units: Iterable[int]) -> set[int]:
    """The slot offsets (bytes) of the views of ``units``' tensors in ``s``'s snapshot."""
    base = s.slot.data.data_ptr()
    return {s.views[e.key].data_ptr() - base for i in units for e in s.layout.units[i].entries}
