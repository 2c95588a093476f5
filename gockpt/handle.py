"""The result side of a checkpoint request: its handle and its metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import MODES


@dataclass
class CheckpointMetrics:
    """What one checkpoint cost and delivered.

    Attributes:
        path: checkpoint directory.
        mode: the mode it ran in.
        num_overlap_steps: K, the training steps its copy spanned.
        requested_step / captured_step: optimizer updates applied at the request / in the data.
        stall_s: training-thread stall in seconds (sum of ``stall_by_phase_s``).
        stall_by_phase_s: seconds by phase (setup (one-time work of a save: a directory claimed,
            the layout enumerated, the replay self-check), slot_wait, copy, window_end (the wait
            for a window's copy), window_check (the version check after it), grad_copy,
            grad_buffer (a capture's wait for a gradient buffer the CPU replay still held), capture,
            static_copy (buffers and tensors outside the optimizer, copied at the capture),
            guard, flush, persist for ``sync``).
        state_bytes / grad_bytes: bytes copied to the host (state, gradients); 0 for a save that
            shared the snapshot of another (``host_shared`` and not the first of them).
        unchanged_bytes: bytes of tensors not copied to the host again because the host slot
            still held them unchanged from an earlier checkpoint (``frozen_copy="when_changed"``).
        persist_bytes: bytes written to storage.
        linked_bytes: bytes of shard files not written but hard-linked from the checkpoint
            before it, which holds the very same bytes (``frozen_copy="when_changed"``, local
            filesystems: shards of frozen tensors unchanged since).
        host_bytes: host memory this checkpoint held while in flight, in bytes (its snapshot slot
            and gradient buffers, as allocated: a reused slot may be larger than needed). Saves
            sharing one snapshot each report the same buffers (counted once in
            ``host_peak_bytes``).
        slot_borrowed: its host slot was borrowed from the save before it while that one was
            still writing it out; its copies waited only for the bytes they overwrite
            (counted as ``slot_wait``).
        host_shared: this checkpoint's snapshot was shared with other saves requested at the
            same step (one host copy, one set of copies and replays, its own files and state).
        host_peak_bytes: the most bytes of host buffers (snapshot slots and gradient buffers, of
            every save together) the engine held at once, from its start to this checkpoint's end.
        time_to_durable_s: seconds from the request to the publish.
        persist_s: seconds spent persisting; ``persist_gbps`` = persist_bytes / persist_s / 1e9.
        replay_backend: backend used for replay (empty when nothing was replayed).
        predicted_stall_s: the predicted stall of this save, seconds: the planner's stall model
            per window for its copy plan (GoCkpt §4.2.3; 0.0 before costs were measured), plus
            the per-save fixed cost: the mean over the latest saves of their stall outside the
            phases the model predicts (``request``, ``capture``, ``window_check`` and short
            waits such as one for a free slot), setup left out, plus
            ``predicted_slot_wait_s``.
        predicted_replay_wait_s: of ``predicted_stall_s``, the predicted ``grad_buffer`` wait,
            seconds (:func:`gockpt.plan.replay_wait_s`; 0.0 before a replay rate was measured).
        predicted_slot_wait_s: of ``predicted_stall_s``, the predicted wait for the bytes of a
            borrowed host slot (``slot_borrowed``) that the save before is still writing out,
            seconds: the most, over its copy windows ``j``, of the time that persist needs
            to write out block ``j``'s bytes (at its pace so far pooled with that of the
            latest persist that wrote all its bytes, or ended), less the time until window
            ``j`` opens (``j`` times the median time between updates). 0.0 for a slot of its
            own, and where no persist has written anything yet. Where checkpoints come faster
            than storage persists them, this is most of the stall.
        stall_lower_bound_s: the least stall any plan of at most ``max_overlap_steps`` windows
            could have for the same measured costs (:func:`gockpt.plan.stall_lower_bound_s`),
            plus the same fixed cost, seconds (``predicted_slot_wait_s`` left out).
        expected_interval_steps: the steps to the next checkpoint request the plan expected
            (the median gap of the latest requests; None before two requests at different steps,
            and where the host pool may hold more than one slot: ``host_buffer_bytes`` set with
            ``max_inflight`` > 1).
            K avoids ending its windows right before that request; a K beyond it has the next
            request copy the blocks left (``flush`` stall) and share the snapshot
            (:func:`gockpt.plan.make_plan`).
        skipped: the request found no free slot with ``when_full="skip"``.
        superseded: a newer save of the same path was published first; this one was dropped.
        planned_window_s: the copy window, in seconds, the plan sized its blocks for (a
            quantile of the latest windows, :attr:`gockpt.GoCkptConfig.window_quantile`,
            :attr:`gockpt.plan.CopyPlan.window_s`); None when
            the plan was not costed (no window measured yet) and for ``sync``/``async``,
            which copy at the request. Read beside
            ``window_margins_s``: a save whose steps ran shorter than planned ends its windows
            late.
        window_margins_s: per copy window that ran to its end, seconds from its copy finishing
            to the window end (negative: the training thread waited that long at the
            ``window_end``); empty where the host cannot see when a copy ended (CUDA).
        device_wait_s: CUDA: seconds the compute stream waited on the device, at this save's
            window ends, for copies still running (timed with CUDA events: the update queued
            behind the copy, while the host went on). Not part of ``stall_s``, which is the
            host's; a training loop that reads its loss each step waits for it too. 0.0 on
            the CPU, where that wait is the host's ``window_end``.
    """

    path: str
    mode: str
    num_overlap_steps: int
    requested_step: int
    captured_step: int | None = None
    stall_s: float = 0.0
    stall_by_phase_s: dict[str, float] = field(default_factory=dict)
    state_bytes: int = 0
    grad_bytes: int = 0
    unchanged_bytes: int = 0
    persist_bytes: int = 0
    linked_bytes: int = 0
    host_bytes: int = 0
    host_shared: bool = False
    slot_borrowed: bool = False
    host_peak_bytes: int = 0
    time_to_durable_s: float = 0.0
    persist_s: float = 0.0
    persist_gbps: float = 0.0
    replay_backend: str = ""
    predicted_stall_s: float = 0.0
    predicted_replay_wait_s: float = 0.0
    predicted_slot_wait_s: float = 0.0
    stall_lower_bound_s: float = 0.0
    expected_interval_steps: int | None = None
    skipped: bool = False
    superseded: bool = False
    planned_window_s: float | None = None
    window_margins_s: list[float] = field(default_factory=list)
    device_wait_s: float = 0.0

    def add_stall(self, phase: str, seconds: float) -> None:
        self.stall_by_phase_s[phase] = self.stall_by_phase_s.get(phase, 0.0) + seconds
        self.stall_s += seconds

    def log_dict(self) -> dict[str, float]:
        """The scalars adapters send to the user's loggers, under ``gockpt/``: stall (s), bytes
        written, throughput (GB/s), time to durable (s), K, mode (index in
        :data:`gockpt.MODES`), requested and captured step (0 when none), bytes not copied
        again (``unchanged_bytes``) and linked instead of written (``linked_bytes``), and the
        device's wait at window ends (``device_wait_s``, s; 0.0 on the CPU)."""
        return {
            "gockpt/stall_s": self.stall_s,
            "gockpt/bytes": float(self.persist_bytes),
            "gockpt/gbps": self.persist_gbps,
            "gockpt/time_to_durable_s": self.time_to_durable_s,
            "gockpt/num_overlap_steps": float(self.num_overlap_steps),
            "gockpt/mode": float(MODES.index(self.mode)) if self.mode in MODES else -1.0,
            "gockpt/requested_step": float(self.requested_step),
            "gockpt/captured_step": float(self.captured_step or 0),
            "gockpt/unchanged_bytes": float(self.unchanged_bytes),
            "gockpt/linked_bytes": float(self.linked_bytes),
            "gockpt/device_wait_s": self.device_wait_s,
        }

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)


class SaveHandle:
    """The future of one checkpoint request.

    Attributes:
        path: checkpoint directory.
        metrics: live metrics (complete once done).
    """

    def __init__(self, path: str, metrics: CheckpointMetrics) -> None:
        self.path = path
        self.metrics = metrics
        self._future: Future[CheckpointMetrics] = Future()
        self._owner = threading.get_ident()
        self._flush: Callable[[], None] | None = None
        # The save's error was raised to the training thread by result(): the engine does not
        # raise it again at its next boundary.
        self._error_raised = False
        self._overtaken = False

    @property
    def requested_step(self) -> int:
        """Optimizer updates applied when the checkpoint was requested."""
        return self.metrics.requested_step

    @property
    def captured_step(self) -> int | None:
        """The step whose state the checkpoint holds, once taken."""
        return self.metrics.captured_step

    @property
    def skipped(self) -> bool:
        return self.metrics.skipped

    @property
    def overtaken(self) -> bool:
        """Whether the save ended unwritten for a reason that is a warning, not an error of the
        run: the live state moved on past any step it could hold (an update the engine did not
        see, the run stopped inside an update), or the checkpoint before it held its host
        memory too long. :meth:`result` raises its error (``CheckpointTornError``,
        ``CheckpointTimeoutError``); the engine never does, and the checkpoints before it stand."""
        return self._overtaken

    def done(self) -> bool:
        """Whether the checkpoint is durable, failed, cancelled or skipped."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the checkpoint is durable, failed, cancelled or skipped.

        ``fn`` runs on the thread that finishes the checkpoint (a persist thread), or at once on
        the calling thread when it is already done; it must not block for long.
        """
        self._future.add_done_callback(lambda _f: fn(self))

    def result(self, timeout_s: float | None = None) -> CheckpointMetrics:
        """Block until durable; returns its metrics.

        Called on the training thread while the checkpoint is still in its copy windows, it
        first finishes them at the current step (as :meth:`Engine.wait` does).

        Raises:
            TimeoutError: not done within ``timeout_s`` seconds.
            The save's error (``CheckpointCancelledError`` when removed in flight). Raised here
            on the training thread, the engine does not raise it again at its next boundary.
        """
        try:
            return self.outcome(timeout_s)
        except BaseException:
            if self._future.done() and threading.get_ident() == self._owner:
                self._error_raised = True
            raise

    def outcome(self, timeout_s: float | None = None) -> CheckpointMetrics:
        """As :meth:`result`, for code that looks at how the save ended (a framework adapter
        logging its metrics): an error raised here is still raised by the engine at its next
        boundary."""
        if not self._future.done() and self._flush is not None \
                and threading.get_ident() == self._owner:
            # Waiting on the training thread for a save still in its copy windows would wait
            # for training that cannot run: finish the windows at this step instead.
            self._flush()
        return self._future.result(timeout_s)
