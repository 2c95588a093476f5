"""Planning a save on the training thread, and choosing each optimizer's replay backend.

:class:`Planner` owns the cached state layout and slot layout, the copy plan (mode, K, blocks)
and the gradient-buffer layout. :class:`ReplayBackends` owns the backend chosen for each
optimizer; choosing one runs the replay self-check (:func:`gockpt.selfcheck.select_backend`), so
it is an explicit step of the engine, never a side effect of planning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import warnings
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._unchanged import rememberable
from .config import GoCkptConfig
from .layout import Entry, StateLayout, build_layout, layout_signature
from .plan import MULTI_STEP_MODES, CopyPlan, Costs, make_plan
from .replay import ReplayBackend, is_replayable
from .selfcheck import select_backend
from .snapshot import SlotLayout, plan_slot
from .transfer import PRIORITY_GRAD

_ALIGN = 64

log = logging.getLogger("gockpt")

#: Optimizers whose update of an element reads only that element's parameter, gradient and
#: state (and scalars): replaying them on a local shard of a ``DTensor`` is exact (issue 13).
ELEMENTWISE_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam", "RAdam", "ASGD",
})


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ReplayBackends:
    """The replay backend of each optimizer, chosen once (on first use) and kept.

    Read by the replay thread (:meth:`select`) and by the persist (:attr:`info`, recorded in the
    manifest).
    """

    def __init__(self, optimizers: list[Optimizer], config: GoCkptConfig) -> None:
        self._optimizers = optimizers
        self._config = config
        self._backends: dict[int, ReplayBackend] = {}
        self.info: dict[int, dict[str, Any]] = {}
        self._paces: dict[int, float] = {}  # state bytes/s of each choice on its timing probe

    def select(self, opt_index: int) -> ReplayBackend:
        """The backend of optimizer ``opt_index``; the first call runs the self-check."""
        if opt_index not in self._backends:
            opt = self._optimizers[opt_index]
            backend, info, pace = _select_backend(opt, self._config.replay_backend)
            self._backends[opt_index] = backend
            self.info[opt_index] = info
            self._paces[opt_index] = pace
        return self._backends[opt_index]

    def select_all(self) -> bool:
        """Choose every optimizer's backend; True when a self-check ran now (a one-time cost)."""
        ran = len(self._backends) < len(self._optimizers)
        for i in range(len(self._optimizers)):
            self.select(i)
        return ran

    def probe_bytes_per_s(self) -> float:
        """The slowest chosen backend's pace on the self-check's timing probe, bytes of state
        per second (:attr:`gockpt.selfcheck.BackendChoice.replay_bytes_per_s`); 0.0 before a
        backend was chosen or where none was timed."""
        paces = [p for p in list(self._paces.values()) if p > 0]
        return min(paces) if paces else 0.0

    def select_replayable(self) -> None:
        for i, o in enumerate(self._optimizers):
            if is_replayable(o):
                self.select(i)


class Planner:
    """Layouts and copy plans of the saves of one engine (training thread only)."""

    def __init__(self, model: nn.Module, optimizers: list[Optimizer], config: GoCkptConfig,
                 copier: Any, copy_bytes_per_s: float,
                 replay_bytes_per_s: Callable[[], float] | None = None,
                 replay_backlog_bytes: Callable[[], int] | None = None) -> None:
        self._model = model
        self._optimizers = optimizers
        self._config = config
        self._copier = copier
        self._copy_bw = copy_bytes_per_s
        self._replay_rate = replay_bytes_per_s  # the pipeline's measured replay rate
        self._replay_backlog = replay_backlog_bytes  # the pipeline's replays still queued
        self._layout: StateLayout | None = None
        self.layouts_built = 0  # layouts enumerated so far (the first and each change)
        # Updates this engine has seen applied (its own count; the version may start at a
        # resumed run's step, before a stateful optimizer has made its state).
        self.updates_seen = 0
        self._slot_cache: tuple[StateLayout, SlotLayout] | None = None
        self._warned_fallback = False
        # Sharded engines (gockpt.sharded): the (mode, K) every rank follows, from this rank's
        # plan (a collective); called at the end of every plan().
        self.agree: Callable[[CopyPlan], tuple[str, int]] | None = None
        # Sharded engines: whether any rank finishes its saves in flight for want of a host slot
        # (a collective, from this rank's need; gockpt._record.take_host), so that all do.
        self.agree_flush: Callable[[bool], bool] | None = None
        # Partitioned engines (replicated state, gockpt.partition): the share of the layout
        # this rank stores; applied to every layout built.
        self.select: Callable[[StateLayout], StateLayout] | None = None
        self._requests: deque[int] = deque(maxlen=4)  # steps of the latest requests, distinct

    def note_request(self, version: int) -> int | None:
        """Record a checkpoint request at step ``version`` (optimizer updates applied) and
        return the steps the next request is expected after: the median (lower) of the gaps
        between the latest distinct request steps; None before two. Requests at the same step
        (one checkpoint under two names) count once; a step below the last one (the state was
        restored) starts the record anew."""
        if self._requests and version < self._requests[-1]:
            self._requests.clear()
        if not self._requests or version != self._requests[-1]:
            self._requests.append(version)
        steps = list(self._requests)
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        return statistics.median_low(gaps) if gaps else None

    @property
    def layout(self) -> StateLayout | None:
        """The layout :meth:`current_layout` gave last (None before, or once forgotten)."""
        return self._layout

    def forget_layout(self) -> None:
        """Rebuild the layout at the next save (the live tensors were replaced)."""
        self._layout = None

    def current_layout(self) -> tuple[StateLayout, dict[str, Any]]:
        """The state layout, re-enumerated where the live tensors changed, and the model's
        ``state_dict(keep_vars=True)`` read to tell (a capture at this request reuses it: one
        traversal of the module tree fewer on the training thread)."""
        model_sd = self._model.state_dict(keep_vars=True)
        sig = layout_signature(self._model, self._optimizers, model_sd)
        if self._layout is None or self._layout.signature != sig:
            self.layouts_built += 1
            layout = build_layout(self._model, self._optimizers)
            self._layout = layout if self.select is None else self.select(layout)
            self._slot_cache = None
        return self._layout, model_sd

    def may_replay(self, layout: StateLayout, mode: str, exact_step: bool, version: int) -> bool:
        """Whether :meth:`plan` may pick a multi-step mode: the backends must be chosen first."""
        if exact_step and mode not in ("sync", "async"):
            mode = "lazy"
        return mode in MULTI_STEP_MODES + ("auto",) and self._replayable(layout, version)

    def plan(self, layout: StateLayout, mode: str, exact_step: bool, cap: int | None, *,
             version: int, window_s: float | None, overhead_samples_s: tuple[float, ...] = (),
             unchanged: Callable[[Entry], bool] | None = None,
             interval_steps: int | None = None, step_s: float | None = None,
             grad_overlap: bool = True) -> CopyPlan:
        """The copy plan of one save (``window_s``: the measured copy window in seconds, None if
        unknown; ``overhead_samples_s``: how much longer than its bytes at the copy rate each
        recent window's copy ran, seconds, :attr:`gockpt.plan.Costs.overhead_samples_s`), with
        its predicted stall and lower bound (:func:`gockpt.plan.make_plan`); logged at DEBUG. ``unchanged(entry)``: the host slot likely still holds that tensor
        (``frozen_copy="when_changed"``), so its copy costs nothing. ``interval_steps``: the
        steps to the next request (:meth:`note_request`), None if unknown. ``step_s``: the
        seconds between updates, None if unknown (:attr:`gockpt.plan.Costs.step_s`).
        ``grad_overlap``: as :func:`gockpt.plan.make_plan`'s."""
        replayable = self._replayable(layout, version)
        opts = self._optimizers
        local_update = [o for o in opts if type(o).__name__ not in ELEMENTWISE_OPTIMIZERS]
        if layout.sharded and mode in MULTI_STEP_MODES + ("auto",) and local_update:
            # A shard's update would read elements another rank holds: copy in one step.
            replayable = False
            if not self._warned_fallback:
                names = sorted({type(o).__name__ for o in local_update})
                warnings.warn(f"gockpt: {', '.join(names)} does not update a parameter shard "
                              "elementwise; sharded checkpoints use mode 'lazy'", stacklevel=3)
                self._warned_fallback = True
            mode = "lazy"
        elif mode in MULTI_STEP_MODES + ("auto",) and not all(is_replayable(o) for o in opts):
            if not self._warned_fallback:
                names = sorted({type(o).__name__ for o in opts if not is_replayable(o)})
                # stacklevel: this, Engine.save, its caller.
                warnings.warn(f"gockpt: cannot replay {', '.join(names)} on the CPU; "
                              "using mode 'lazy' (single-step overlapped copy)", stacklevel=3)
                self._warned_fallback = True
        if exact_step and mode not in ("sync", "async"):
            mode = "lazy"
        unit_bytes = [0 if unchanged is not None and rememberable(u) and unchanged(u.param_entry)
                      else u.state_bytes for u in layout.units]
        # A frozen parameter gets no gradient: nothing to copy or replay for it (GoCkpt §4.2.1).
        grad_bytes = [u.grad_bytes if u.param.requires_grad else 0 for u in layout.units]
        # Buffers and parameters without an optimizer are copied when the state is taken.
        static_bytes = sum(e.spec.nbytes for e in layout.static
                           if unchanged is None or not unchanged(e))  # buffers: never held
        hi = self._config.max_overlap_steps if cap is None else min(cap, self._config.max_overlap_steps)
        costs = self._costs(window_s, overhead_samples_s, step_s)

        def plan_for(m: str, k_lo: int, k_hi: int) -> CopyPlan:
            return make_plan(m, unit_bytes, grad_bytes, costs, max_overlap_steps=k_hi,
                             replayable=replayable, min_overlap_steps=k_lo,
                             grad_overlap=grad_overlap,
                             static_bytes=static_bytes, interval_steps=interval_steps,
                             # Ranks that agree on K share a snapshot only at that same K; a
                             # request that skips when no slot is free finishes no windows to
                             # share.
                             next_request_shares=self.agree is None
                             and self._config.when_full == "wait")

        plan = plan_for(mode, min(self._config.min_overlap_steps, hi), hi)
        if self.agree is not None:
            agreed, k = self.agree(plan)
            if (agreed, k) != (plan.mode, plan.num_overlap_steps):
                # Blocks sized per window for the agreed K and priced as this rank runs them
                # (windows, replay waits); the bound stays the one over every K this rank allows.
                plan = dataclasses.replace(plan_for(agreed, k, k), lower_bound_s=plan.lower_bound_s)
        if log.isEnabledFor(logging.DEBUG):  # describe() walks every unit: not on every save
            log.debug("gockpt: plan %s", plan.describe(unit_bytes))
        return plan

    def _replayable(self, layout: StateLayout, version: int) -> bool:
        # With several optimizers, K-1 updates could end between two optimizers' steps of one
        # iteration, a state no loop resumes from: those engines copy in one step (lazy).
        # Replay cannot create optimizer state: an update must have made it first, one seen
        # here or one before a resume that loaded it (a stateless optimizer, plain SGD, has
        # none to make: it waits for one update too).
        started = self.updates_seen > 0 or (version > 0 and all(o.state for o in self._optimizers))
        return (started and len(self._optimizers) == 1
                and all(is_replayable(o) for o in self._optimizers)
                and not _state_missing(layout))

    def _costs(self, window_s: float | None, overhead_samples_s: tuple[float, ...] = (),
               step_s: float | None = None) -> Costs | None:
        if window_s is None:
            return None
        copier = self._copier
        bw = self._copy_bw
        done, busy = copier.rate_sample()
        if busy > 0.05:  # enough copying seen to trust the measured pace over the probe's
            bw = done / busy
        replay = self._replay_rate() if self._replay_rate is not None else 0.0
        backlog = self._replay_backlog() if self._replay_backlog is not None else 0
        return Costs(copy_bytes_per_s=bw, window_s=window_s, overhead_samples_s=overhead_samples_s,
                     replay_bytes_per_s=replay, step_s=step_s or 0.0,
                     replay_backlog_s=backlog / replay if replay > 0 else 0.0)

    def slot_layout(self, layout: StateLayout) -> SlotLayout:
        """Where each tensor of ``layout`` lives in a host slot and in the shard files."""
        if self._slot_cache is None or self._slot_cache[0] is not layout:
            apart: set[str] = set()
            if self._config.frozen_copy == "when_changed":
                # Frozen tensors in shards of their own, which a later checkpoint may link.
                frozen = {f"model.{n}" for n, p in self._model.named_parameters()
                          if not p.requires_grad}  # stored keys (gockpt.layout.build_layout)
                apart = {u.param_entry.key for u in layout.units if rememberable(u)}
                apart |= {e.key for e in layout.static if e.key in frozen}
            self._slot_cache = (layout, plan_slot([e.spec for e in layout.entries],
                                                  self._config.max_shard_bytes, apart))
        return self._slot_cache[1]

    def grad_layout(self, layout: StateLayout, plan: CopyPlan) -> tuple[dict[int, int], tuple[int, int]]:
        """Byte offset of each unit's gradient in a gradient buffer, and each buffer's size.

        The gradients of the update ending window ``j`` (blocks 0..j, j < K - 1) go to buffer
        ``j % 2``, laid out in block order: buffer ``t`` needs the bytes up to the end of the
        last block it ever holds (K = 2 uses one buffer only).
        """
        if plan.mode not in MULTI_STEP_MODES or plan.num_overlap_steps < 2:
            return {}, (0, 0)
        offsets, off, ends = {}, 0, []
        for block in plan.blocks[:-1]:
            for i in block:
                offsets[i] = off
                off = _align(off + layout.units[i].grad_bytes)
            ends.append(off)
        last = len(ends) - 1  # the window of the last gradient capture
        return offsets, (ends[last - last % 2], ends[last - 1 + last % 2] if last >= 1 else 0)

    def check_host_budget(self, per_slot: int) -> None:
        """Raises ValueError when ``host_buffer_bytes`` cannot hold one slot of ``per_slot``."""
        budget = self._config.host_buffer_bytes
        if budget is not None and per_slot > budget:
            raise ValueError(
                f"host_buffer_bytes={budget} cannot hold one checkpoint ({per_slot} bytes needed)")


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def probe_copy_bandwidth(copier: Any, device: torch.device, cap: float | None) -> float:
    """Device-to-host bytes per second of one 8 MiB copy through ``copier``, at most ``cap``.

    One copy first warms the path (the first pinned allocation, the stream, the copy thread);
    the second is timed from before it is queued to its end. The clock must start before the
    call: a CUDA copy is issued inside it and may have ended when it returns, which read an
    H200's link as several times its real pace, so one-step plans were chosen where the copy
    took three steps. The planner replaces this figure with the pace measured on the saves'
    own copies once it has seen enough of them. Under an emulated link (``cap``, which the
    copier's throttle holds it to) the copy is made smaller where 8 MiB would take over 50 ms
    at ``cap`` (down to 64 KiB): at a few hundred KB/s the probe took a minute per engine start.

    The time taken is the copier's own timing of that copy (``copier.rate_sample()``: a CUDA
    copy on the device's clock, between events bracketing it) where it timed it, at most the
    host's wall clock around the call: that clock also counts the launch and the wait for the
    copy's event, 0.1-0.2 ms, which made an 8 MiB copy on an H200 read 27 GB/s where the saves'
    own copies moved 50 GB/s (a warm-up save then planned several windows for a copy one
    window hid, and pinned gradient buffers no later save used).
    """
    n = 8 << 20
    if cap is not None:
        n = max(64 << 10, min(n, int(cap * 0.05)))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    copier.copy([(src, dst)], PRIORITY_GRAD).wait()
    done0, busy0 = copier.rate_sample()
    t0 = perf_counter()
    copier.copy([(src, dst)], PRIORITY_GRAD).wait()
    wall = perf_counter() - t0
    done1, busy1 = copier.rate_sample()
    busy = busy1 - busy0
    # Only where the copier timed this copy alone (its bytes, within the wall time).
    took = busy if done1 - done0 == n and 0 < busy <= wall else wall
    bw = n / max(took, 1e-9)
    if cap is not None:
        bw = min(bw, cap)
    return bw


def infer_step(optimizers: list[Optimizer]) -> int:
    """Updates already applied, from the optimizers' ``step`` state: the sum over the optimizers
    of each one's largest (the engine counts every optimizer's update, so a checkpoint of two
    optimizers at iteration 6 holds step 12); 0 for an optimizer without one (plain SGD)."""
    total = 0
    for o in optimizers:
        best = 0
        for st in o.state.values():
            v = st.get("step") if isinstance(st, dict) else None
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                best = max(best, int(v.item()))
            elif isinstance(v, (int, float)):
                best = max(best, int(v))
        total += best
    return total


def _select_backend(opt: Optimizer, preference: str,
                    ) -> tuple[ReplayBackend, dict[str, Any], float]:
    choice = select_backend(opt, preference)
    return choice.backend, {"backend": choice.backend.name, "exact": choice.exact,
                            "max_abs_error": _json_float(choice.max_abs_error),
                            "candidates": {k: _json_float(v) for k, v in choice.candidates.items()}
                            }, choice.replay_bytes_per_s


def _json_float(x: float) -> float | str:
    """``x``, or its name (``"inf"``, ``"nan"``) where strict JSON has no number for it: the
    manifest is read back with NaN/Infinity refused."""
    return x if math.isfinite(x) else str(x)


def _state_missing(layout: StateLayout) -> bool:
    """Whether a trainable parameter has no optimizer state yet while others of its optimizer do.

    Replay cannot create state that did not exist when the block was copied (it would be lost),
    so such a checkpoint is copied in one step.
    """
    has_state = {u.optimizer_index for u in layout.units if u.state_entries}
    return any(u.optimizer_index in has_state and not u.state_entries and u.param.requires_grad
               for u in layout.units)
