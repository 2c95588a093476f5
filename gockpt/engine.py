"""The engine: multi-step overlapped checkpoints with gradient assist and exact CPU replay.

Call sequence of one checkpoint in a multi-step mode (K windows, requested at update N), with the
thread each step runs on (GoCkpt §4.2-§4.4):

1. (training thread) ``save()`` right after update N: plan K and the blocks, take a host slot,
   queue the D2H copy of block 0.
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
7. (persist pool + I/O threads) shards, then the manifest, then the atomic publish and the
   ``latest`` pointer (PCcheck §4.1).
8. (any thread) ``handle.result()``.

``lazy`` is K = 1 (DataStates-LLM §V-A2); ``async`` copies everything at the request; ``sync``
also persists on the training thread.
"""

from __future__ import annotations

import io
import itertools
import logging
import queue
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from . import _exit
from .config import GoCkptConfig
from .format import ShardLayout
from .handle import CheckpointMetrics, SaveHandle
from .layout import StateLayout, Unit, build_layout, layout_signature
from .persist import CheckpointCancelledError, PersistRequest, persist
from .plan import MULTI_STEP_MODES, CopyPlan, Costs, make_plan
from .replay import ReplayBackend, TorchReplay, is_replayable, snapshot_hparams
from .selfcheck import select_backend
from .snapshot import host_view, plan_slot, storage_key, to_skeleton
from .storage import claim_directory, cleanup_staging, remove_checkpoint
from .transfer import (
    PRIORITY_GRAD,
    PRIORITY_STATE,
    CheckpointTornError,
    CopyTicket,
    Slot,
    SlotPool,
    make_copier,
)

log = logging.getLogger("gockpt")

_ALIGN = 64


@dataclass
class _Save:
    seq: int
    path: str
    handle: SaveHandle
    plan: CopyPlan
    layout: StateLayout
    slot: Slot
    views: dict[str, torch.Tensor]
    grad_views: list[dict[int, torch.Tensor]]
    shards: list[ShardLayout]
    shard_bases: list[int]
    state_fn: Callable[[], Any] | None
    target: int
    t_request: float
    window: int = 0
    window_open: bool = False
    tickets: dict[int, CopyTicket] = field(default_factory=dict)
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    extra: Any = None
    grad_turn: int = 0
    grad_tickets: list[CopyTicket] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    failed: BaseException | None = None
    overtaken: bool = False  # a tracked tensor was edited outside an update before its copy
    finalized: bool = False

    @property
    def metrics(self) -> CheckpointMetrics:
        return self.handle.metrics

    @property
    def num_blocks(self) -> int:
        return len(self.plan.blocks)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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
            optimizers' ``step`` state (0 when they have none). Checkpoints record steps from
            here, and the ``latest`` pointer only moves forward in steps.

    Raises:
        TypeError: ``optimizers`` holds something that is not a ``torch.optim.Optimizer``.
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
        self.explicit_before_update = explicit_before_update
        self.metrics: list[CheckpointMetrics] = []
        self.version = _infer_step(self.optimizers) if start_step is None else start_step
        self._seq = itertools.count()
        self._saves: list[_Save] = []
        self._all: list[_Save] = []
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._published_seq: dict[str, int] = {}
        self._layout: StateLayout | None = None
        self._shard_cache: tuple | None = None
        self._warned_fallback = False
        self._fallback_warned = False
        self._backends: dict[int, ReplayBackend] = {}
        self._backend_info: dict[int, dict[str, Any]] = {}
        self._t_update_end: float | None = None
        self._window_s: float | None = None
        self._pending_grads: list[tuple[CopyTicket, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._guard_handles: list = []
        self._closed = False
        self._cleaned_dirs: set[str] = set()
        self._claims: list = []  # one writer per checkpoint directory (gockpt.storage.claim_directory)
        # Parameter versions after each optimizer's latest update: a save requested after an
        # edit outside optimizer.step() (a weight swap, load_state_dict) is copied at once.
        self._updated_versions = {i: self._param_versions(i) for i in range(len(self.optimizers))}

        device = self._device()
        self._copier = make_copier(device, self.config.chunk_bytes, self.config.host_link_bytes_per_s)
        self._pool = SlotPool(self.config.max_inflight, pin=device.type == "cuda",
                              max_bytes=self.config.host_buffer_bytes)
        self._host_budget_checked = False
        self._persist_pool = ThreadPoolExecutor(self.config.max_inflight, thread_name_prefix="gockpt-persist")
        self._replay_q: queue.Queue = queue.Queue()
        self._replay_thread = threading.Thread(target=self._replay_loop, name="gockpt-replay", daemon=True)
        self._replay_thread.start()
        self._hooks = []
        for i, o in enumerate(self.optimizers):
            self._hooks.append(o.register_step_pre_hook(lambda *_a, _i=i: self._on_pre_hook(_i)))
            self._hooks.append(o.register_step_post_hook(lambda *_a, _i=i: self._on_post_hook(_i)))
            self._wrap_zero_grad(o)
        self._hooks.append(model.register_forward_pre_hook(lambda *_a: self._on_forward()))
        # load_state_dict overwrites live tensors in place: pending copies finish first, so a
        # checkpoint requested before it holds the state it was requested at.
        for m in model.modules():
            self._hooks.append(m.register_load_state_dict_pre_hook(self._before_load))
        for o in self.optimizers:
            self._hooks.append(o.register_load_state_dict_pre_hook(self._before_load))
        self._exit_token = _exit.register(self._close_at_exit)
        self._copy_bw = self._probe_copy_bandwidth(device)
        if self.config.mode in MULTI_STEP_MODES + ("auto",):
            for i, o in enumerate(self.optimizers):
                if is_replayable(o):
                    self._backend(i)

    # ------------------------------------------------------------------ public API

    def save(
        self,
        path: str,
        *,
        state_fn: Callable[[], Any] | None = None,
        exact_step: bool = False,
        mode: str | None = None,
        max_overlap_steps: int | None = None,
    ) -> SaveHandle:
        """Request a checkpoint of the state after the latest optimizer update.

        Call on the training thread at a step boundary (after ``optimizer.step()`` and the
        scheduler step). Returns after the request's stall only.

        Args:
            path: checkpoint directory (local path or fsspec URL).
            state_fn: returns the non-tensor state (loop counters, scheduler, RNG, ...); called on
                the training thread at the captured step and serialized at once (deep copy).
            exact_step: hold exactly the requested step (K = 1).
            mode: override of ``config.mode`` for this checkpoint.
            max_overlap_steps: upper bound on K for this checkpoint only (>= 1), e.g. the
                updates left before a point the caller cannot resume from (an epoch end); it
                also lowers ``config.min_overlap_steps``.

        Returns:
            A :class:`SaveHandle`; ``result()`` gives :class:`CheckpointMetrics`.

        Raises:
            RuntimeError: the engine is closed; a background error of an earlier checkpoint.
            ValueError: unknown mode; ``host_buffer_bytes`` too small for one checkpoint.
        """
        self._check_open()
        self._raise_errors()
        self._boundary()
        path = path.rstrip("/") or path
        t0 = time.perf_counter()
        parent = path.rstrip("/").rpartition("/")[0] or "."
        if parent not in self._cleaned_dirs:
            # One writing process per directory (refuses a second one; a dead or closed one
            # does not block); then scratch files of writers killed mid-save.
            claim = claim_directory(parent, self.config.storage_options,
                                    timeout_s=self.config.storage_timeout_s)
            self._claims.append(claim)
            cleanup_staging(parent, self.config.storage_options)
            self._cleaned_dirs.add(parent)
        layout = self._current_layout()
        if max_overlap_steps is not None and max_overlap_steps < 1:
            raise ValueError(f"max_overlap_steps must be >= 1, got {max_overlap_steps}")
        mode = mode or self.config.mode
        if mode not in ("sync", "async") and self._edited_since_update():
            # The parameters were edited outside optimizer.step() (a weight swap around this
            # save): the code that edited them may change them back before a later copy would
            # run, so this save copies at the request, as a blocking save would.
            log.info("gockpt: %s: parameters changed outside optimizer.step(); copied at the "
                     "request (async)", path)
            mode = "async"
        plan = self._plan(layout, mode, exact_step or max_overlap_steps == 1, max_overlap_steps)
        seq = next(self._seq)
        metrics = CheckpointMetrics(path=path, mode=plan.mode, num_overlap_steps=plan.num_overlap_steps,
                                    requested_step=self.version)
        handle = SaveHandle(path, metrics)
        handle._flush = self._flush_windows
        shards, bases, slot_bytes = self._shard_layout(layout)
        grad_offsets, grad_bytes = self._grad_layout(layout, plan)
        self._check_host_budget(slot_bytes + 2 * grad_bytes)
        tw = time.perf_counter()
        slot = self._pool.acquire(slot_bytes, grad_bytes, block=False)
        if slot is None and self.config.when_full == "wait":
            # A save already past its windows frees its slot without training; saves still in
            # their copy windows only advance with training, so when they hold every slot, finish
            # them at this step, or the pool would wait for ever.
            if not any(x.finalized and not x.handle.done() for x in self._all):
                self._flush_windows()
            slot = self._pool.acquire(slot_bytes, grad_bytes, block=True,
                                      timeout=getattr(self.config, "slot_wait_timeout_s", None))
            if slot is None:
                warnings.warn(f"gockpt: no host slot freed within slot_wait_timeout_s; skipped "
                              f"checkpoint {path} (the checkpoints in flight are still being "
                              "persisted: storage slower than the checkpoint interval?)", stacklevel=2)
        metrics.add_stall("slot_wait", time.perf_counter() - tw)
        if slot is None:
            metrics.skipped = True
            handle._future.set_result(metrics)
            log.info("gockpt: no free host slot, skipped checkpoint %s", path)
            return handle
        views = {}
        for e in layout.entries:
            views[e.key] = host_view(slot.data, self._slot_offset(e.key), e.tensor)
        grad_views = [
            {i: host_view(g, off, layout.units[i].param) for i, off in grad_offsets.items()}
            for g in slot.grads
        ]
        prefix = f"shard-{uuid.uuid4().hex[:8]}"
        shards = [ShardLayout(s.file.replace("shard", prefix, 1), s.header, s.offsets, s.data_bytes)
                  for s in shards]
        s = _Save(seq, path, handle, plan, layout, slot, views, grad_views, shards, bases, state_fn,
                  target=self.version + plan.num_overlap_steps - 1, t_request=t0)
        self._all = [x for x in self._all if not x.handle.done()]
        self._all.append(s)
        try:
            return self._start(s, t0)
        except BaseException as e:
            # Nothing of this request may linger: the slot goes back, the handle fails.
            s.cancel.set()
            if s in self._saves:
                self._saves.remove(s)
            self._drain(s)
            if not s.handle.done():
                self._pool.release(slot)
                s.handle._future.set_exception(e)
            raise

    def _start(self, s: _Save, t0: float) -> SaveHandle:
        plan, metrics, handle = s.plan, s.metrics, s.handle
        if plan.mode in ("sync", "async"):
            self._copy_blocks(s, range(s.num_blocks), wait=True)
            self._capture(s)
            metrics.add_stall("copy", time.perf_counter() - t0 - metrics.stall_s)
            if plan.mode == "sync":
                ts = time.perf_counter()
                self._persist(s)
                metrics.add_stall("persist", time.perf_counter() - ts)
                self._raise_errors()
                handle.result()
            else:
                self._replay_q.put(("finalize", s))
            return handle
        self._saves.append(s)
        self._open_window(s)
        if s.target == self.version:
            self._capture(s)
        metrics.add_stall("request", max(0.0, time.perf_counter() - t0 - metrics.stall_s))
        return handle

    def step_end(self) -> None:
        """Mark a step boundary (after the optimizer and scheduler steps).

        Checkpoints whose captured step is the current step take their non-tensor state here.
        """
        self._raise_errors()
        self._boundary()

    def before_update(self) -> None:
        """End the copy window: called right before an optimizer update (explicit mode).

        Waits for the block copied in this window (counted as stall).

        Raises:
            A background error of an earlier checkpoint.
        """
        self._raise_errors()
        self._window_end()

    def flush(self) -> None:
        """Finish the copy windows of every pending checkpoint now, at the current step.

        Call at a step boundary before code that changes parameters, buffers or optimizer state
        outside ``optimizer.step()`` (weight averaging swapping weights in through ``.data``, an
        in-place ``copy_``; ``load_state_dict`` of the model, any of its submodules or the
        optimizers does it by itself): afterwards no pending checkpoint reads the live tensors. A
        checkpoint whose captured step was not reached yet is captured at the current step
        (``state_fn`` is called now). Persisting goes on in the background.

        Raises:
            A background error of an earlier checkpoint.
        """
        self._flush_windows()
        self._raise_errors()

    def wait(self, timeout_s: float | None = None) -> list[CheckpointMetrics]:
        """Finish every pending checkpoint now and block until all are durable.

        Blocks not yet copied are copied at the current step, which becomes their captured step.
        Call while the model and optimizers are still on their device.

        Returns:
            Metrics of the checkpoints finished by this call.

        Raises:
            The first background error; TimeoutError after ``timeout_s`` seconds.
        """
        t0 = time.perf_counter()
        self._flush_windows()
        out = []
        deadline = None if timeout_s is None else t0 + timeout_s
        for s in list(self._all):
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                out.append(s.handle.result(left))
            except TimeoutError:
                raise
            except BaseException:  # noqa: BLE001 - failures are raised once, below
                pass
        self._all = [s for s in self._all if not s.handle.done()]
        self._raise_errors()
        return out

    def remove(self, path: str) -> None:
        """Delete the checkpoint at ``path``, cancelling an in-flight save of it first.

        No partial files of the cancelled save are left behind.

        Raises:
            OSError: the storage refused the deletion.
        """
        for s in [s for s in self._all if s.path == path]:
            s.cancel.set()
            if s in self._saves:
                self._saves.remove(s)
                self._finalize(s)
        for s in [s for s in self._all if s.path == path]:
            try:
                s.handle.result()
            except BaseException:  # noqa: BLE001 - the save was cancelled on purpose
                pass
        self._all = [s for s in self._all if not (s.path == path and s.handle.done())]
        remove_checkpoint(path, self.config.storage_options, timeout_s=self.config.storage_timeout_s)

    def restore(self, path: str, *, allow_pickle: bool = False) -> Any:
        """Load a checkpoint into the live model and optimizers; returns its non-tensor state.

        Raises:
            FileNotFoundError: no complete checkpoint at ``path``.
            CheckpointCorruptError: a corrupt file (names the file and key).
            ValueError: a tensor whose shape or dtype does not fit the model (names the key).
        """
        from .restore import load_checkpoint, load_into

        self.wait()
        state = load_checkpoint(path, storage_options=self.config.storage_options,
                                verify=self.config.verify_on_load, allow_pickle=allow_pickle)
        load_into(self.model, self.optimizers, state)
        self.version = state.captured_step
        self._layout = None
        return state.extra

    def close(self) -> None:
        """Finish pending checkpoints, remove hooks, stop threads.

        Raises:
            The first background error not raised before.
        """
        if self._closed:
            return
        _exit.unregister(self._exit_token)
        try:
            self.wait()
        finally:
            self._closed = True
            for h in self._hooks:
                h.remove()
            for o in self.optimizers:
                o.__dict__.pop("zero_grad", None)
            self._replay_q.put(("stop", None))
            self._replay_thread.join()
            self._persist_pool.shutdown(wait=True)
            self._copier.close()
            for claim in self._claims:
                claim.release()
        self._raise_errors()

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

    def _on_pre_hook(self, _i: int) -> None:
        self._raise_errors()
        self._release_guards(wait=False)
        if not self.explicit_before_update:
            self._window_end()
        elif any(s.extra is None and s.target == self.version for s in self._saves):
            self._boundary()

    def _on_post_hook(self, opt_index: int) -> None:
        now = time.perf_counter()
        self.version += 1
        self._t_update_end = now
        self._updated_versions[opt_index] = self._param_versions(opt_index)
        for s in list(self._saves):
            if s.window_open:
                self._fail(s, CheckpointTornError(
                    f"{s.path}: an optimizer update ran while block {s.window} was being copied; "
                    "call before_update() before every update in explicit mode"))
                continue
            if s.window >= s.num_blocks - 1:
                continue
            self._capture_grads(s, opt_index)
            s.window += 1
            self._open_window(s)

    def _param_versions(self, opt_index: int) -> list[tuple[torch.Tensor, int]]:
        return [(p, p._version) for g in self.optimizers[opt_index].param_groups for p in g["params"]]

    def _edited_since_update(self) -> bool:
        """True if a parameter changed in place after its optimizer's latest update."""
        return any(p._version != v for vs in self._updated_versions.values() for p, v in vs)

    def _before_load(self, *_a: Any, **_k: Any) -> None:
        if any(not s.finalized for s in self._saves):
            self._flush_windows()

    def _on_forward(self) -> None:
        if self._saves and any(s.extra is None and s.target == self.version for s in self._saves):
            self._boundary()

    def _wrap_zero_grad(self, opt: Optimizer) -> None:
        # An in-place zero_grad(set_to_none=False) would overwrite gradients still being copied
        # in gockpt_o mode; wait for those copies first.
        original = opt.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            if not set_to_none:
                self._release_guards(wait=True)
            original(set_to_none=set_to_none)

        opt.zero_grad = zero_grad  # type: ignore[method-assign]

    # ------------------------------------------------------------------ windows

    def _flush_windows(self) -> None:
        """Finish the copy windows of every pending save at the current step."""
        self._release_guards(wait=True)
        for s in list(self._saves):
            tf = time.perf_counter()
            try:
                if s.window_open:
                    s.tickets[s.window].wait()
                    self._check_versions(s)
                rest = range(s.window + 1, s.num_blocks)
                if len(rest):
                    self._copy_blocks(s, rest, wait=True)
            except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
                self._fail(s, e)
                continue
            s.window_open = False
            s.window = s.num_blocks - 1
            s.target = self.version
            s.metrics.num_overlap_steps = s.target - s.metrics.requested_step + 1
            if s.extra is None and not self._try_capture(s):
                continue
            s.metrics.add_stall("flush", time.perf_counter() - tf)
            self._finalize(s)

    def _window_end(self) -> None:
        now = time.perf_counter()
        if self._t_update_end is not None:
            w = now - self._t_update_end
            self._window_s = w if self._window_s is None else 0.8 * self._window_s + 0.2 * w
        for s in list(self._saves):
            if not s.window_open:
                continue
            t0 = time.perf_counter()
            try:
                s.tickets[s.window].fence_compute()
                self._check_versions(s)
            except BaseException as e:  # noqa: BLE001 - fails this checkpoint only
                self._fail(s, e)
                continue
            s.window_open = False
            s.metrics.add_stall("window_end", time.perf_counter() - t0)
            if s.extra is None and s.target == self.version:
                if not self._fallback_warned and s.num_blocks > 1:
                    warnings.warn("gockpt: non-tensor state taken at the next update's window end; "
                                  "call engine.step_end() after each step for the exact boundary",
                                  stacklevel=3)
                    self._fallback_warned = True
                if not self._try_capture(s):
                    continue
            if s.window == s.num_blocks - 1:
                self._finalize(s)

    def _open_window(self, s: _Save) -> None:
        self._copy_blocks(s, [s.window], wait=False)
        s.window_open = True

    def _copy_blocks(self, s: _Save, blocks: Sequence[int] | range, wait: bool) -> None:
        pairs = []
        s.versions = []
        for j in blocks:
            for i in s.plan.blocks[j]:
                u = s.layout.units[i]
                for e in (u.param_entry, *u.state_entries.values()):
                    pairs.append((e.tensor, s.views[e.key]))
                    s.versions.append((e.tensor, e.tensor._version))
        nbytes = sum(d.numel() * d.element_size() for _, d in pairs)
        s.metrics.state_bytes += nbytes
        ticket = self._copier.copy(pairs, PRIORITY_STATE)
        for j in blocks:
            s.tickets[j] = ticket
        if wait:
            ticket.wait()
            self._check_versions(s)

    def _check_versions(self, s: _Save) -> None:
        for t, v in s.versions:
            if t._version != v:
                # Not an engine fault: code outside optimizer.step() edited the state after the
                # request. This save cannot hold the requested state; training goes on.
                s.overtaken = True
                raise CheckpointTornError(
                    f"{s.path}: a tensor changed while it was copied (edited outside "
                    "optimizer.step() after the save was requested); this checkpoint is not "
                    "written. Call engine.flush() before such edits, or save with mode='async'")

    def _capture_grads(self, s: _Save, opt_index: int) -> None:
        """Copy the gradients of update ``self.version`` for blocks 0..window (GoCkpt §4.2.2)."""
        opt = self.optimizers[opt_index]
        units = [
            i for j in range(s.window + 1) for i in s.plan.blocks[j]
            if s.layout.units[i].optimizer_index == opt_index and s.layout.units[i].param.grad is not None
            and not (not s.layout.units[i].state_entries and opt.state.get(s.layout.units[i].param))
        ]
        turn = s.grad_turn
        s.grad_turn ^= 1
        t0 = time.perf_counter()
        s.slot.grad_busy[turn].wait()  # the replay of the update before last has released it
        s.metrics.add_stall("grad_buffer", time.perf_counter() - t0)
        s.slot.grad_busy[turn].clear()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = [
            (s.layout.units[i].param.grad, s.grad_views[turn][i]) for i in units  # type: ignore[misc]
        ]
        hparams = [snapshot_hparams(g) for g in opt.param_groups]
        ticket = self._copier.copy(pairs, PRIORITY_GRAD, check_versions=True)
        s.grad_tickets.append(ticket)
        s.metrics.grad_bytes += ticket.nbytes
        if s.plan.mode == "gockpt":
            t0 = time.perf_counter()
            ticket.wait()
            s.metrics.add_stall("grad_copy", time.perf_counter() - t0)
        else:
            self._guard(ticket, pairs)
        record = (opt_index, type(opt), hparams, units, turn)
        self._replay_q.put(("replay", s, record, ticket))

    def _guard(self, ticket: CopyTicket, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # gockpt_o (§4.2.4): the copy overlaps the next forward; the next backward must not
        # accumulate into a gradient still being read. A tensor hook on each parameter fires
        # before accumulation, so it waits there when the same gradient tensor is still live.
        self._pending_grads.append((ticket, pairs))
        by_grad = {id(g) for g, _ in pairs}
        for o in self.optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    if p.grad is not None and id(p.grad) in by_grad and p.requires_grad:
                        self._guard_handles.append(p.register_hook(self._guard_hook(p, ticket)))

    def _guard_hook(self, p: torch.Tensor, ticket: CopyTicket):
        def hook(grad: torch.Tensor) -> None:
            if p.grad is not None and not ticket.done():
                t0 = time.perf_counter()
                ticket.wait()
                for s in self._saves:
                    s.metrics.add_stall("guard", (time.perf_counter() - t0) / max(1, len(self._saves)))
        return hook

    def _release_guards(self, wait: bool) -> None:
        if not self._pending_grads:
            return
        if wait:
            for t, _ in self._pending_grads:
                t.wait()
        if all(t.done() for t, _ in self._pending_grads):
            self._pending_grads.clear()
            for h in self._guard_handles:
                h.remove()
            self._guard_handles.clear()

    # ------------------------------------------------------------------ capture and finalize

    def _boundary(self) -> None:
        for s in list(self._saves):
            if s.extra is None and s.target == self.version:
                self._try_capture(s)

    def _try_capture(self, s: _Save) -> bool:
        try:
            self._capture(s)
            return True
        except BaseException as e:  # noqa: BLE001 - fails this checkpoint; raised at the next hook
            self._fail(s, e)
            return False

    def _capture(self, s: _Save) -> None:
        """Take the state tree, buffers and param groups at the captured step.

        The tree (``state_fn()``, the model's state_dict, the optimizers' state_dicts) is copied
        at once with :func:`gockpt.snapshot.to_skeleton`: a tensor that is a tracked tensor of
        this save becomes a reference to its shard entry, any other tensor (a hook's edit,
        optimizer state created inside the copy window) is copied to the CPU now. Units whose
        optimizer state appeared or was replaced during the windows are not referenced: their
        host copies were not brought forward, so their live values are copied here instead.
        """
        t0 = time.perf_counter()
        # One traversal of the module tree serves both the state tree and the buffers.
        current = self.model.state_dict(keep_vars=True)
        live: dict[tuple, str] = {}
        for u in s.layout.units:
            if self._dirty(u):
                continue
            live[storage_key(u.param_entry.tensor)] = u.param_entry.key
            for e in u.state_entries.values():
                live[storage_key(e.tensor)] = e.key
        pairs = []
        if s.layout.static:
            # Re-read: a forward may rebind a buffer (``self.count = self.count + 1``).
            for e in s.layout.static:
                t = current.get(e.key[len("model."):]) if e.key.startswith("model.") else e.tensor
                if not isinstance(t, torch.Tensor) or t.dtype != e.spec.dtype \
                        or tuple(t.shape) != e.spec.shape:
                    raise CheckpointTornError(f"{s.path}: {e.key} changed shape or dtype during the save")
                pairs.append((t.detach(), s.views[e.key]))
                live[storage_key(t)] = e.key
        if pairs:
            t = self._copier.copy(pairs, PRIORITY_GRAD)
            t.wait()
            s.metrics.state_bytes += t.nbytes
        # The skeleton owns copies of everything that is not a reference, so it is serialized
        # later on the persist thread.
        s.extra = {
            "user": to_skeleton(s.state_fn(), live) if s.state_fn is not None else None,
            "optimizers": [to_skeleton(o.state_dict(), live) for o in self.optimizers],
            "model": to_skeleton(current, live),
        }
        s.metrics.captured_step = self.version
        s.metrics.add_stall("capture", time.perf_counter() - t0)

    def _dirty(self, u: Unit) -> bool:
        """Whether ``u``'s optimizer state is no longer the tensors its host copy was taken from."""
        st = self.optimizers[u.optimizer_index].state.get(u.param, {})
        now = {n: storage_key(t) for n, t in st.items() if isinstance(t, torch.Tensor)}
        return now != {n: storage_key(e.tensor) for n, e in u.state_entries.items()}

    def _finalize(self, s: _Save) -> None:
        if s.finalized:
            return
        s.finalized = True
        if s in self._saves:
            self._saves.remove(s)
        self._replay_q.put(("finalize", s))

    def _drain(self, s: _Save) -> None:
        # Copies still writing into this slot must end before the slot can be reused.
        for t in [*s.tickets.values(), *s.grad_tickets]:
            try:
                t.wait()
            except BaseException:  # noqa: BLE001 - the save already failed or was cancelled
                pass

    def _fail(self, s: _Save, e: BaseException) -> None:
        s.failed = e
        s.cancel.set()
        self._finalize(s)

    # ------------------------------------------------------------------ background

    def _replay_loop(self) -> None:
        while True:
            item = self._replay_q.get()
            kind, s = item[0], item[1]
            if kind == "stop":
                return
            try:
                if kind == "replay":
                    self._replay(s, *item[2:])
                else:
                    self._persist_pool.submit(self._persist, s)
            except BaseException as e:  # noqa: BLE001 - reported through the handle
                s.failed = s.failed or e
                s.cancel.set()

    def _replay(self, s: _Save, record: tuple, ticket: CopyTicket) -> None:
        opt_index, cls, hparams, units, turn = record
        try:
            if s.cancel.is_set():
                return
            ticket.wait()  # raises CheckpointTornError when a gradient changed during its copy
            backend = self._backend(opt_index)
            s.metrics.replay_backend = backend.name
            by_group: dict[int, list[tuple[int, Unit]]] = {}
            for i in units:
                u = s.layout.units[i]
                by_group.setdefault(u.group_index, []).append((i, u))
            for gi, members in by_group.items():
                be = backend
                if be.name != "torch" and not (
                    be.supports(cls, hparams[gi])
                    and all(u.param.dtype == torch.float32 for _, u in members)
                ):
                    be = TorchReplay()  # the self-check probed fp32 with group 0's flags
                be.step(
                    cls, hparams[gi],
                    [s.views[u.param_entry.key] for _, u in members],
                    [s.grad_views[turn][i] for i, _ in members],
                    [{n: s.views[e.key] for n, e in u.state_entries.items()} for _, u in members],
                )
        finally:
            s.slot.grad_busy[turn].set()

    def _persist(self, s: _Save) -> None:
        m = s.metrics
        self._drain(s)
        try:
            if s.failed is not None:
                raise s.failed
            if s.cancel.is_set():
                raise CheckpointCancelledError(f"{s.path}: cancelled")
            meta = {
                "requested_step": m.requested_step,
                "captured_step": m.captured_step,
                "mode": m.mode,
                "num_overlap_steps": m.num_overlap_steps,
                "model_keys": s.layout.model_keys,
                "num_optimizers": len(self.optimizers),
                "replay": self._backend_info.get(0, {}),
                "created_unix_s": time.time(),
            }
            blob = io.BytesIO()
            torch.save(s.extra, blob)
            req = PersistRequest(
                path=s.path, shards=s.shards, slot=s.slot.data, shard_bases=s.shard_bases,
                extra=blob.getvalue(), aliases=s.layout.aliases, meta=meta,
                storage_options=self.config.storage_options, num_io_threads=self.config.num_io_threads,
                chunk_bytes=self.config.chunk_bytes, update_latest=self.config.update_latest,
                cancel=s.cancel, publish_lock=self._publish_lock,
                storage_timeout_s=self.config.storage_timeout_s,
                is_superseded=lambda: self._published_seq.get(s.path, -1) > s.seq,
                on_published=lambda: self._published_seq.__setitem__(s.path, s.seq),
            )
            res = persist(req)
            m.superseded = not res.published
            m.persist_bytes = res.bytes_written
            m.persist_s = res.seconds
            m.persist_gbps = res.bytes_written / res.seconds / 1e9 if res.seconds > 0 else 0.0
            m.time_to_durable_s = time.perf_counter() - s.t_request
        except BaseException as e:  # noqa: BLE001 - handed to the handle and the training thread
            self._pool.release(s.slot)
            if s.overtaken:
                # Never a torn checkpoint, never a failed run: the previous checkpoints stand.
                log.warning("gockpt: %s", e)
            elif not isinstance(e, CheckpointCancelledError) or s.failed is not None:
                with self._lock:
                    self._errors.append(e)
            s.handle._future.set_exception(e)
            return
        self._pool.release(s.slot)
        if not m.superseded:
            self.metrics.append(m)
        log.info("gockpt: %s durable (%s, K=%d, stall %.4fs)", s.path, m.mode, m.num_overlap_steps, m.stall_s)
        s.handle._future.set_result(m)

    # ------------------------------------------------------------------ planning helpers

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _probe_copy_bandwidth(self, device: torch.device) -> float:
        n = 8 << 20
        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
        t = self._copier.copy([(src, dst)], PRIORITY_GRAD)
        t0 = time.perf_counter()
        t.wait()
        bw = n / max(time.perf_counter() - t0, 1e-9)
        if self.config.host_link_bytes_per_s is not None:
            bw = min(bw, self.config.host_link_bytes_per_s)
        return bw

    def _costs(self) -> Costs | None:
        if self._window_s is None:
            return None
        copier = self._copier
        bw = self._copy_bw
        if getattr(copier, "busy_s", 0.0) > 0.05:
            bw = copier.bytes_copied / copier.busy_s
        return Costs(copy_bytes_per_s=bw, window_s=self._window_s)

    def _current_layout(self) -> StateLayout:
        sig = layout_signature(self.model, self.optimizers)
        if self._layout is None or self._layout.signature != sig:
            self._layout = build_layout(self.model, self.optimizers)
            self._shard_cache = None
        return self._layout

    def _plan(self, layout: StateLayout, mode: str, exact_step: bool, cap: int | None = None) -> CopyPlan:
        # With several optimizers, K-1 updates could end between two optimizers' steps of one
        # iteration, a state no loop resumes from: those engines copy in one step (lazy).
        replayable = (self.version > 0 and len(self.optimizers) == 1
                      and all(is_replayable(o) for o in self.optimizers)
                      and not _state_missing(layout))
        if mode in MULTI_STEP_MODES + ("auto",) and not all(is_replayable(o) for o in self.optimizers):
            if not self._warned_fallback:
                names = sorted({type(o).__name__ for o in self.optimizers if not is_replayable(o)})
                warnings.warn(f"gockpt: cannot replay {', '.join(names)} on the CPU; "
                              "using mode 'lazy' (single-step overlapped copy)", stacklevel=3)
                self._warned_fallback = True
        if exact_step and mode not in ("sync", "async"):
            mode = "lazy"
        unit_bytes = [u.state_bytes for u in layout.units]
        grad_bytes = [u.grad_bytes for u in layout.units]
        if mode in MULTI_STEP_MODES + ("auto",) and replayable:
            for i in range(len(self.optimizers)):
                self._backend(i)
        hi = self.config.max_overlap_steps if cap is None else min(cap, self.config.max_overlap_steps)
        return make_plan(mode, unit_bytes, grad_bytes, self._costs(),
                         max_overlap_steps=hi, replayable=replayable,
                         min_overlap_steps=min(self.config.min_overlap_steps, hi))

    def _shard_layout(self, layout: StateLayout) -> tuple[list[ShardLayout], list[int], int]:
        if self._shard_cache is None or self._shard_cache[0] is not layout:
            sl = plan_slot([e.spec for e in layout.entries], self.config.max_shard_bytes)
            self._shard_cache = (layout, sl.shards, sl.bases, sl.nbytes, sl.offsets)
        return self._shard_cache[1], self._shard_cache[2], self._shard_cache[3]

    def _slot_offset(self, key: str) -> int:
        assert self._shard_cache is not None
        return self._shard_cache[4][key]

    def _grad_layout(self, layout: StateLayout, plan: CopyPlan) -> tuple[dict[int, int], int]:
        if plan.mode not in MULTI_STEP_MODES or plan.num_overlap_steps < 2:
            return {}, 0
        offsets, off = {}, 0
        for block in plan.blocks[:-1]:
            for i in block:
                offsets[i] = off
                off = _align(off + layout.units[i].grad_bytes)
        return offsets, off

    def _check_host_budget(self, per_slot: int) -> None:
        budget = self.config.host_buffer_bytes
        if budget is not None and per_slot > budget:
            raise ValueError(
                f"host_buffer_bytes={budget} cannot hold one checkpoint ({per_slot} bytes needed)")

    def _backend(self, opt_index: int) -> ReplayBackend:
        if opt_index not in self._backends:
            opt = self.optimizers[opt_index]
            backend, info = _select_backend(opt, self.config.replay_backend)
            self._backends[opt_index] = backend
            self._backend_info[opt_index] = info
        return self._backends[opt_index]

    # ------------------------------------------------------------------ errors

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")

    def _raise_errors(self) -> None:
        if self._errors:
            with self._lock:
                e = self._errors.pop(0)
            # The original exception, with its type and cause chain: ``except CheckpointTornError``
            # and friends must work on the training thread.
            raise e


def _strip_tensors(sd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict without its per-parameter tensors (stored in shards)."""
    return {
        "state": {idx: {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
                  for idx, st in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }


def _select_backend(opt: Optimizer, preference: str) -> tuple[ReplayBackend, dict[str, Any]]:
    choice = select_backend(opt, preference)
    return choice.backend, {"backend": choice.backend.name, "exact": choice.exact,
                            "max_abs_error": choice.max_abs_error, "candidates": choice.candidates}


def _infer_step(optimizers: list[Optimizer]) -> int:
    """Updates already applied, from the optimizers' ``step`` state (0 when absent)."""
    best = 0
    for o in optimizers:
        for st in o.state.values():
            v = st.get("step") if isinstance(st, dict) else None
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                best = max(best, int(v.item()))
            elif isinstance(v, (int, float)):
                best = max(best, int(v))
    return best


def _state_missing(layout: StateLayout) -> bool:
    """Whether a trainable parameter has no optimizer state yet while others of its optimizer do.

    Replay cannot create state that did not exist when the block was copied (it would be lost),
    so such a checkpoint is copied in one step.
    """
    has_state = {u.optimizer_index for u in layout.units if u.state_entries}
    return any(u.optimizer_index in has_state and not u.state_entries and u.param.requires_grad
               for u in layout.units)
