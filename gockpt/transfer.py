"""Transfer: D2H copies into reusable host buffers, with gradients ahead of state.

One interface, two paths:

- CPU (every test runs it): a background thread copies in ``chunk_bytes`` pieces; ``Tensor.copy_``
  releases the GIL, so the training thread keeps running (DataStates-LLM §V-A2).
- CUDA: copies are issued on a dedicated stream with one event per job; the host waits on the
  event only where the data must be complete (GoCkpt §4.4.1: pinned memory, a separate stream).

Gradient jobs have priority over state jobs (GoCkpt §4.2.2): gradients live for one step, state
for the whole window. Host buffers come from :class:`SlotPool`, allocated once and reused,
bounded, with back-pressure when full (DataStates-LLM §V-A4, PCcheck §3.1).
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from time import monotonic, perf_counter
from typing import Any

import torch

from . import _trace
from ._direct import aligned_empty, host_empty
from ._unchanged import HeldTensors
from .errors import CheckpointTornError

PRIORITY_GRAD = 0
PRIORITY_STATE = 1


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *,
                 non_blocking: bool) -> None:
    """``dst.copy_(src)`` for each pair of ``dsts`` and ``srcs``, autograd off, in one dispatch
    (one release of the GIL for the lot).

    One ``torch._foreach_copy_`` call issues every copy from C++. On the CUDA path a job's copies
    are issued on the training thread, inside the request; with a Python loop (``copy_`` and
    ``detach`` per tensor) the request took 4 ms for 145 tensors on an H200 against 1.5 ms on
    the CPU path, which queues the job to a thread (1.2 GB of state; the difference is inferred
    to be the loop, not timed apart). Sources and destinations on different devices go through
    the foreach kernel's per-tensor fallback, still in C++. Where ``torch`` lacks the op or
    refuses the lists, the copies are issued one by one (a copy already made is made again).

    Args:
        dsts: destination tensors; each one's dtype wins.
        srcs: source tensors, as many as ``dsts``, each of its destination's shape.
        non_blocking: passed to ``copy_``: a device-to-pinned-host copy is only queued.

    Raises:
        RuntimeError: a copy the per-tensor path also refuses (shapes that do not match).
    """
    if not dsts:
        return
    with torch.no_grad():
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None:
            try:
                foreach(dsts, srcs, non_blocking=non_blocking)
                return
            except (RuntimeError, TypeError):
                pass  # nothing was written that the loop does not write again
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=non_blocking)


class CopyTicket:
    """Completion of one copy job. ``wait()`` blocks until done and re-raises its error.

    Attributes:
        nbytes: bytes the job copies.
        done_at: ``time.perf_counter()`` seconds at which the background copy finished (CPU
            path); None while running, and on the CUDA path (the host does not see when an
            event completes without waiting on it).
    """

    def __init__(self, nbytes: int, event: object | None = None,
                 device: torch.device | None = None) -> None:
        self.nbytes = nbytes
        self._device = device  # CUDA: the device whose compute stream a fence orders
        self.done_at: float | None = None
        self._versions: list[tuple[torch.Tensor, int]] = []
        # CUDA: (weak reference, version) of sources checked when the host first sees the event
        # complete (_settle); weak, so a gradient set to None is freed as without a save.
        self._weak_versions: list[tuple[weakref.ref, int]] = []
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._cuda_event = event
        # CUDA: timing events on the compute stream around its wait for this copy, when the
        # copy had not ended at the fence (the device waits; the host does not).
        self._device_wait: tuple[Any, Any] | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self.done_at = perf_counter()
        self._done.set()

    def done(self) -> bool:
        """Whether the copy finished (successfully or not)."""
        if self._cuda_event is not None:
            ended = bool(self._cuda_event.query())  # type: ignore[attr-defined]
            if ended:
                self._settle()
            return ended
        return self._done.is_set()

    def wait(self) -> None:
        """Block the calling thread until the host buffers hold the data.

        Raises:
            The copy's error, if it failed.
        """
        if self._cuda_event is not None:
            self._cuda_event.synchronize()  # type: ignore[attr-defined]
            self._settle()
            if self._error is not None:
                raise self._error
            return
        self._done.wait()
        if self._error is not None:
            raise self._error

    def watch_sources(self, sources: Sequence[torch.Tensor]) -> None:
        """CUDA: check ``sources`` for in-place writes when the host first sees the copy end.

        The copy stream waited for the compute stream at the request, but a write the loop
        queues afterwards (``p.grad.zero_()``, ``module.zero_grad(set_to_none=False)``) runs on
        the compute stream unordered against the copy. A write queued before the host saw the
        copy's event complete may have landed during the copy, so it tears the ticket; one
        queued after cannot have. The guards (tensor hooks, the ``zero_grad`` wrapper) wait for
        the ticket before letting a write through, which settles it first."""
        self._weak_versions = [(weakref.ref(t), t._version) for t in sources]

    def _settle(self) -> None:
        # A source already freed was not written after the copy was queued by anything that
        # still holds it (its memory stays reserved for the copy stream: record_stream).
        pending, self._weak_versions = self._weak_versions, []
        for ref, version in pending:
            t = ref()
            if t is not None and t._version != version and self._error is None:
                self._error = CheckpointTornError(
                    "a tensor was modified in place while it was copied (an in-place "
                    "zero_grad(set_to_none=False) or a write to .grad right after the update)")

    def fence_compute(self) -> None:
        """Order the device's compute stream after this copy (CUDA), or wait (CPU).

        Called at a window end: the next optimizer update must not overwrite what is still being
        read. On CUDA this costs the host nothing.
        """
        if self._cuda_event is not None:
            # The copier's device, not the current one: a model on cuda:1 trained without
            # torch.cuda.set_device would otherwise order another device's stream.
            stream = torch.cuda.current_stream(self._device)
            with torch.cuda.device(self._device):
                capturing = torch.cuda.is_current_stream_capturing()
            if capturing:  # a graph capture: no query, no timing
                stream.wait_event(self._cuda_event)  # type: ignore[arg-type]
                return
            if self._cuda_event.query():  # type: ignore[attr-defined]
                return  # ended: nothing to order
            before = torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(self._cuda_event)  # type: ignore[arg-type]
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            self._device_wait = (before, after)
        else:
            self.wait()

    def device_wait_s(self) -> float:
        """Seconds the device's compute stream waited at :meth:`fence_compute` for this copy
        (CUDA; 0.0 where it had ended by then, and on the CPU, where the wait is the host's).
        Blocks until the compute stream has passed the fence: call it off the training thread."""
        if self._device_wait is None:
            return 0.0
        before, after = self._device_wait
        after.synchronize()
        return before.elapsed_time(after) / 1000.0  # milliseconds


class CpuCopier:
    """Copies on a background thread, in chunks, gradient jobs first.

    Args:
        chunk_bytes: copy granularity in bytes.
        bytes_per_s: emulated link bandwidth (sleeps, which releases the GIL and burns no CPU,
            so that ``n`` bytes take at least ``n / bytes_per_s`` seconds); None for no limit.
    """

    def __init__(self, chunk_bytes: int, bytes_per_s: float | None = None) -> None:
        self._chunk = chunk_bytes
        self._rate = bytes_per_s
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gockpt-copy", daemon=True)
        self._thread.start()
        self.bytes_copied = 0
        self.busy_s = 0.0

    def rate_sample(self) -> tuple[int, float]:
        """(bytes, seconds) of the copies finished so far: what the link moved while busy."""
        return self.bytes_copied, self.busy_s

    def copy(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], priority: int,
        check_versions: bool = False,
    ) -> CopyTicket:
        """Queue copies of ``src`` into ``dst`` (same dtype and number of elements) for each pair.

        Args:
            pairs: (src, dst); ``dst`` are contiguous host tensors.
            priority: :data:`PRIORITY_GRAD` or :data:`PRIORITY_STATE`.
            check_versions: fail the ticket with :class:`CheckpointTornError` when a source tensor was
                modified in place between the request and the end of its copy.

        Returns:
            A ticket that completes when every pair is copied.
        """
        nbytes = sum(d.numel() * d.element_size() for _, d in pairs)
        ticket = CopyTicket(nbytes)
        if check_versions:
            ticket._versions = [(src, src._version) for src, _ in pairs]
        chunks = self._chunks(pairs)
        with self._cv:
            if self._closed:
                raise RuntimeError("copier is closed")
            heapq.heappush(self._heap, (priority, next(self._seq), chunks, ticket))
            self._cv.notify()
        return ticket

    def _chunks(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        """Yield ``(srcs, dsts)``, flat byte views of at most ``chunk_bytes`` together: a slice
        of one large tensor, or consecutive small tensors copied in one call. Each call
        releases the GIL and must take it back; one per small tensor (a model's norms, biases,
        adapters: hundreds of them) made the copy thread wait for the GIL that often behind a
        training thread running Python, and slowed its copy by a varying amount."""
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        held = 0
        for src, dst in pairs:
            n = dst.numel() * dst.element_size()
            if srcs and held + n > self._chunk:
                yield srcs, dsts
                srcs, dsts, held = [], [], 0
            if n >= self._chunk:
                s = src.detach().reshape(-1).view(torch.uint8)
                d = dst.reshape(-1).view(torch.uint8)
                for a in range(0, n, self._chunk):
                    b = min(n, a + self._chunk)
                    yield [s[a:b]], [d[a:b]]
                continue
            if src.shape == dst.shape and src.dtype == dst.dtype:
                # As they are: three view ops per tensor, with the GIL held, were most of this
                # thread's Python per save (hundreds of small tensors). The copy runs with
                # autograd off (_run), so a source that requires grad needs no detach.
                srcs.append(src)
                dsts.append(dst)
            else:
                srcs.append(src.detach().reshape(-1).view(torch.uint8))
                dsts.append(dst.reshape(-1).view(torch.uint8))
            held += n
        if srcs:
            yield srcs, dsts

    def _run(self) -> None:
        # busy_s counts wall time while work is queued, the gaps between chunks included (the
        # GIL taken back after each chunk, the heap): the rate the planner sees is the rate
        # copies really move at beside training and the other engine threads.
        since: float | None = None  # end of the previous chunk while the queue stayed non-empty
        torch.set_grad_enabled(False)  # this thread only: copies are never recorded by autograd
        while True:
            with self._cv:
                if not self._heap:
                    since = None
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                job = self._heap[0]  # re-read per chunk: a gradient job may have arrived
            _, _, chunks, ticket = job
            try:
                item = next(chunks, None)
                if item is None:
                    self._drop(job)
                    torn = any(t._version != v for t, v in ticket._versions)
                    ticket._versions = []  # do not keep the sources (gradients) alive
                    ticket._finish(CheckpointTornError(
                        "a tensor was modified in place while it was copied (an in-place "
                        "zero_grad(set_to_none=False) or gradient accumulation in the next step)")
                        if torn else None)
                    continue
                t0 = perf_counter()
                srcs, dsts = item
                n = sum(d.numel() * d.element_size() for d in dsts)
                with _trace.phase("copy", n):
                    copy_tensors(dsts, srcs, non_blocking=False)
                if self._rate is not None:
                    rest = n / self._rate - (perf_counter() - t0)
                    if rest > 0:
                        time.sleep(rest)
                now = perf_counter()
                self.bytes_copied += n
                self.busy_s += now - (t0 if since is None else since)
                since = now
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self._drop(job)
                ticket._finish(e)

    def _drop(self, job: tuple) -> None:
        with self._cv:
            self._heap.remove(job)
            heapq.heapify(self._heap)

    def close(self) -> None:
        """Finish queued jobs and stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()


class CudaCopier:
    """Copies on a dedicated CUDA stream into pinned host buffers; one event per job.

    The source tensors are recorded on the copy stream so the caching allocator does not reuse
    their memory before the copy ends (gradients freed by ``zero_grad(set_to_none=True)``).
    Priority: gradient jobs go on a high-priority stream.

    Each job is bracketed by timing events on its stream, so the link's pace is read from the
    device's own clock once a job has ended (:meth:`rate_sample`), without the host waiting: the
    host sees a CUDA copy only as queued, so its wall clock cannot time one.
    """

    def __init__(self, device: torch.device, chunk_bytes: int, bytes_per_s: float | None = None) -> None:
        self._device = device
        self._state_stream = torch.cuda.Stream(device=device)
        self._grad_stream = torch.cuda.Stream(device=device, priority=-1)
        self.bytes_copied = 0
        self.busy_s = 0.0
        self._timed_bytes = 0
        # (start event, end event, bytes) of jobs not yet read, in the order issued.
        self._pending: collections.deque = collections.deque()
        # Jobs are timed against one reference event, so that jobs on the two streams that
        # overlap count their shared time once (busy_union_ms).
        self._ref: torch.cuda.Event | None = None
        self._covered_ms = -math.inf

    def copy(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], priority: int,
        check_versions: bool = False,
    ) -> CopyTicket:
        # The guards (tensor hooks, the zero_grad wrapper) order the copy before the writes they
        # see; check_versions catches the rest when the host first sees the copy end.
        stream = self._grad_stream if priority == PRIORITY_GRAD else self._state_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        nbytes = 0
        if self._ref is None:
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(stream)
        with torch.cuda.stream(stream):
            # Recorded after the wait on the compute stream: it fires when the copy can start.
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            copy_tensors([d for _, d in pairs], [s for s, _ in pairs], non_blocking=True)
            for src, dst in pairs:
                if src.is_cuda:  # host tensors (Adam's ``step`` counts) need no stream record
                    src.record_stream(stream)
                nbytes += dst.nbytes
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        self.bytes_copied += nbytes
        self._pending.append((start, event, nbytes))
        ticket = CopyTicket(nbytes, event, self._device)
        if check_versions:
            ticket.watch_sources([s for s, _ in pairs])
        return ticket

    def rate_sample(self) -> tuple[int, float]:
        """(bytes, seconds) of the jobs known to have ended, timed on the device between each
        job's start and end events; time in which jobs of the gradient and the state stream
        ran together (sharing the link) is counted once. Never waits: a job still running is
        read on a later call."""
        ended: list[tuple[float, float]] = []
        ref = self._ref
        last_end = None
        # In the order issued, up to the first job still running: a later job read before an
        # earlier, longer one on the other stream ends would have its time counted, and the
        # earlier job's time before it lost (a pace read too fast).
        while self._pending and ref is not None and ref.query() and self._pending[0][1].query():
            start, last_end, n = self._pending.popleft()
            ended.append((ref.elapsed_time(start), ref.elapsed_time(last_end)))  # milliseconds
            self._timed_bytes += n
        busy_ms, self._covered_ms = busy_union_ms(ended, self._covered_ms)
        self.busy_s += busy_ms / 1000.0
        # A recent reference keeps the float milliseconds of elapsed_time fine (they step by
        # 2 ms 8 hours after one reference): none while nothing is pending, else the end of
        # the last job read (it has ended), with the time counted so far moved onto it.
        if not self._pending:
            self._ref, self._covered_ms = None, -math.inf
        elif last_end is not None:
            self._covered_ms -= ref.elapsed_time(last_end)
            self._ref = last_end
        return self._timed_bytes, self.busy_s

    def close(self) -> None:
        self._state_stream.synchronize()
        self._grad_stream.synchronize()


def busy_union_ms(intervals: Sequence[tuple[float, float]], covered: float) -> tuple[float, float]:
    """Time covered by ``intervals`` (``(start, end)``, milliseconds on one clock) and not
    before ``covered`` (the end of the time already counted), and the new ``covered``: copies
    on two streams that overlap share the link, so their common time is counted once.

    A job read on a later call that began before ``covered`` counts only its time after it.
    Written here: a union of intervals, a few lines. Raises nothing."""
    busy = 0.0
    for start, end in sorted(intervals):
        busy += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return busy, covered


def make_copier(device: torch.device, chunk_bytes: int, bytes_per_s: float | None):
    """The copier for tensors on ``device``: CUDA stream copies, or a CPU worker thread."""
    if device.type == "cuda":
        return CudaCopier(device, chunk_bytes, bytes_per_s)
    return CpuCopier(chunk_bytes, bytes_per_s)


def _shared_schedule(sizes: Sequence[int], threads: int) -> Callable[[int, int], float]:
    """Files of ``sizes`` bytes written in order, ``threads`` at a time, sharing one pace: a
    function of ``(file, n)`` giving the bytes written by all together when file ``file`` has
    written its first ``n`` bytes (processor sharing: ``a`` files in progress write ``1/a`` of
    the bytes each)."""
    left = list(sizes)
    queue = collections.deque(range(len(sizes)))
    active: list[int] = []
    t = 0.0
    marks: list[list[tuple[float, int]]] = [[] for _ in sizes]  # per file: (t, written)
    written = [0] * len(sizes)
    while queue or active:
        while queue and len(active) < threads:
            i = queue.popleft()
            active.append(i)
            marks[i].append((t, 0))
        step = min(left[i] for i in active)  # each active file's bytes until the first ends
        t += step * len(active)
        for i in active:
            left[i] -= step
            written[i] += step
            marks[i].append((t, written[i]))
        active = [i for i in active if left[i] > 0]

    def done_at(file: int, n: int) -> float:
        m = marks[file]
        for (t0, w0), (t1, w1) in itertools.pairwise(m):
            if n <= w1:
                return t0 + (n - w0) * (t1 - t0) / (w1 - w0) if w1 > w0 else t1
        return m[-1][0]

    return done_at


class Drain:
    """The byte ranges of a slot that a persist has yet to read, while the slot is lent to the
    next save (:meth:`SlotPool.make_lendable`): that save copies into a range only once no
    pending range overlaps it, so a host buffer is reused as soon as its bytes are written out,
    not when the whole checkpoint is (DataStates-LLM §V-A4, host buffers recycled as they are
    flushed).

    Args:
        files: per file, in the order the persist starts them, the ``[begin, end)`` byte ranges
            of the slot it reads for that file, in the order it writes them; all disjoint
            (:func:`gockpt.persist.slot_chunks`).
        threads: how many files the persist writes at once (its io threads).
    """

    def __init__(self, files: Sequence[Sequence[tuple[int, int]]], threads: int = 1) -> None:
        self.lent = False  # a save borrowed the slot during this persist (SlotPool, its lock)
        self._files = [[(b, e) for b, e in f if b < e] for f in files]
        pending = sorted(r for f in self._files for r in f)
        self._begins = [b for b, _ in pending]
        self._ends = [e for _, e in pending]
        self._threads = max(1, threads)
        self._cv = threading.Condition()
        # The persist's pace, for predicting a borrower's wait (made as the persist starts).
        self._t0 = self._t_last = perf_counter()
        self._read_bytes = 0

    @property
    def done(self) -> bool:
        """Nothing is pending any more."""
        return not self._begins

    def read(self, begin: int, end: int) -> None:
        """The persist has read (written out) ``[begin, end)``, one of the ranges given."""
        self._free(begin, end, written=True)

    def skip(self, begin: int, end: int) -> None:
        """``[begin, end)`` is free without having been written (its file was linked): as
        :meth:`read`, but not part of the persist's pace."""
        self._free(begin, end, written=False)

    def _free(self, begin: int, end: int, *, written: bool) -> None:
        with self._cv:
            i = bisect.bisect_left(self._begins, begin)
            if i < len(self._begins) and self._begins[i] == begin and self._ends[i] == end:
                del self._begins[i], self._ends[i]
                if written:
                    self._t_last = perf_counter()
                    self._read_bytes += end - begin
                self._cv.notify_all()

    def finish(self) -> None:
        """The persist ended (written, failed or cancelled): it reads nothing more."""
        with self._cv:
            self._begins.clear()
            self._ends.clear()
            self._cv.notify_all()

    def pace(self) -> tuple[int, float]:
        """``(bytes, seconds)``: what the persist has written out of the slot, all its threads
        together, and in how long from its start to now (to its last range once done);
        ``(0, 0.0)`` before its first range."""
        with self._cv:
            if not self._read_bytes:
                return 0, 0.0
            t = self._t_last if not self._begins else perf_counter()
            return self._read_bytes, max(t - self._t0, 1e-9)

    def pending_through(self, groups: Sequence[Sequence[tuple[int, int]]]) -> list[float]:
        """Per entry ``j`` of ``groups`` (lists of ``[begin, end)`` slot ranges), how many bytes
        the persist writes, all its threads together, before no pending range overlaps any
        range of ``groups[0]`` to ``groups[j]``; divided by the persist's pace (bytes/s,
        :meth:`pace`), the seconds until then.

        A model of the persist: it writes its files in the order given, ``threads`` at a time,
        each file's ranges in order, and its threads share one pace (storage-bound, the case
        where a borrower waits at all). Left out: the files it writes that hold none of the
        slot (the non-tensor state), the file headers and the fsyncs.
        """
        with self._cv:
            pending = set(self._begins)
            files = [[(b, e) for b, e in f if b in pending] for f in self._files]
            files = [f for f in files if f]
            done_at = _shared_schedule([sum(e - b for b, e in f) for f in files], self._threads)
            where: dict[int, tuple[int, int]] = {}  # range begin -> (file, its bytes through it)
            for i, f in enumerate(files):
                for b, n in zip((b for b, _ in f), itertools.accumulate(e - b for b, e in f),
                                strict=True):
                    where[b] = (i, n)
            out, worst = [], 0.0
            for group in groups:
                for b, e in group:
                    # The pending ranges overlapping [b, e) (disjoint and sorted: a run of them).
                    lo = bisect.bisect_right(self._ends, b)
                    hi = bisect.bisect_left(self._begins, e)
                    for k in range(lo, hi):
                        worst = max(worst, done_at(*where[self._begins[k]]))
                out.append(worst)
            return out

    def _busy(self, begin: int, end: int) -> bool:
        i = bisect.bisect_right(self._ends, begin)  # the first pending range ending after begin
        return i < len(self._begins) and self._begins[i] < end

    def wait_free(self, ranges: Sequence[tuple[int, int]], timeout_s: float | None) -> bool:
        """Block until no pending range overlaps any of ``ranges``; False after ``timeout_s``
        seconds (None: no bound)."""
        deadline = None if timeout_s is None else monotonic() + timeout_s
        with self._cv:
            for b, e in ranges:
                while self._busy(b, e):
                    left = None if deadline is None else deadline - monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left)
        return True


class Slot:
    """Host buffers of one in-flight snapshot: the data and two gradient buffers.

    Saves requested at one step may share one slot (:meth:`SlotPool.share`); it goes back to
    the pool when the last of them releases it.

    Attributes:
        data: (slot_bytes,) uint8; shard data sections at fixed offsets.
        grads: two uint8 buffers used in turn by consecutive updates (turn ``t`` holds the
            gradients of the updates with an even (t = 0) or odd (t = 1) window index, so each
            is only as large as its largest update needs).
        refs: saves holding the slot (written under the pool's lock).
        held: the views of ``data`` that still hold a tensor as copied at a known version
            (``frozen_copy="when_changed"``; training thread only).
        views: the views of ``data`` per tensor key of the latest state layout planned into it
            (training thread only).
        grad_view_cache: the views of ``grads`` made for that layout, per buffer by (unit
            index, offset) (training thread only; see :func:`gockpt._record.new_record`).
        drain: while a persist reads the slot and it may be lent: what it has yet to read
            (``drain.lent``: a save borrowed it, :meth:`SlotPool.acquire` with ``lend``).
        fresh: a buffer was allocated and no save has copied into the slot since.
        grad_idle: per gradient buffer, the acquisitions in a row that needed none of it
            (:data:`GRAD_IDLE_ACQUIRES` of them free it).
    """

    def __init__(self, slot_bytes: int, grad_bytes: int | Sequence[int], pin: bool,
                 data: torch.Tensor | None = None, held: HeldTensors | None = None) -> None:
        sizes = _grad_sizes(grad_bytes)
        # ``data``: a dropped slot's data buffer of ``slot_bytes`` bytes, kept (only its gradient
        # buffers were too small); ``held``: what that buffer still holds.
        # Page-aligned: the persist writes shard data from it with O_DIRECT, no copy between.
        self.data = data if data is not None else aligned_empty(slot_bytes, pin_memory=pin)
        self.grads = [host_empty(n, pin_memory=pin) for n in sizes]
        self.grad_busy: list[threading.Event] = [threading.Event(), threading.Event()]
        for e in self.grad_busy:
            e.set()  # set = free
        self.refs = 0
        self.held = held if held is not None else HeldTensors()
        # (layout, slot layout, key -> view of ``data``): the last layout's views, reused
        self.views: tuple[Any, Any, dict[str, torch.Tensor]] | None = None
        # (layout, the gradient buffers, per buffer (unit index, offset) -> view): reused likewise
        self.grad_view_cache: tuple[Any, tuple[torch.Tensor, ...],
                                    list[dict[tuple[int, int], torch.Tensor]]] | None = None
        self.drain: Drain | None = None
        # No save has copied into it since one of its buffers was allocated (their pages are
        # faulted in by the first copies): its first save's costs are not the steady state's.
        self.fresh = True
        self.grad_idle = [0, 0]

    @property
    def nbytes(self) -> int:
        """Bytes of all its buffers (data and both gradient buffers)."""
        return self.data.numel() + sum(g.numel() for g in self.grads)

    def fits(self, slot_bytes: int, grad_bytes: int | Sequence[int]) -> bool:
        """Whether it holds at least ``slot_bytes`` of data and the gradient buffer sizes."""
        return self.data.numel() >= slot_bytes and all(
            g.numel() >= n for g, n in zip(self.grads, _grad_sizes(grad_bytes), strict=True))


# A gradient buffer that this many acquisitions of its slot in a row needed none of is freed.
# The plan that sized it may never come back (a first save planned before the step time was
# known pinned 469 MB that no later K = 1 save used, on an H200), and the pool should hold one
# checkpoint plus what the plans use (issue 14). Not at the first: plans move between
# neighbouring K, and pinning again costs the training thread 0.1-0.2 s per 300 MB.
GRAD_IDLE_ACQUIRES = 2


def _headroom(want: int, old: int) -> int:
    """The size for a buffer of ``old`` bytes that must hold ``want``: ``old`` if it does, else
    at least half as large again as ``old`` (``want`` for a first allocation)."""
    if want <= old or old == 0:
        return max(want, old)
    return max(want, old + old // 2)


def _grad_sizes(grad_bytes: int | Sequence[int]) -> tuple[int, int]:
    """Per-turn gradient buffer bytes: an int is the size of both."""
    if isinstance(grad_bytes, int):
        return grad_bytes, grad_bytes
    a, b = grad_bytes
    return int(a), int(b)


class SlotPool:
    """A bounded set of :class:`Slot`, allocated on first use and reused.

    Args:
        max_slots: slots that may exist (the engine: 1 when ``host_buffer_bytes`` is None, else
            ``max_inflight``).
        pin: allocate pinned memory (CUDA).
        max_bytes: bound on the bytes of all slots together (``host_buffer_bytes``); None for
            no bound beyond ``max_slots``.
    """

    def __init__(self, max_slots: int, pin: bool, max_bytes: int | None = None) -> None:
        self._max = max_slots
        self._pin = pin
        self._max_bytes = max_bytes
        self._free: list[Slot] = []
        self._draining: list[Slot] = []  # held by one persist only, which may lend them
        self._count = 0
        self._bytes = 0
        self._peak = 0
        self._cv = threading.Condition()
        # The latest persists that let their slot be borrowed: their pace (Drain.pace) counts
        # once they have written everything (done), before they end (fsync, publish).
        self._drains: collections.deque[Drain] = collections.deque(maxlen=8)

    @property
    def max_slots(self) -> int:
        """The most slots that may exist at once."""
        return self._max

    @property
    def num_slots(self) -> int:
        """Slots allocated now (in use or free)."""
        return self._count

    @property
    def bytes(self) -> int:
        """Bytes of host memory the slots hold now (allocated, in use or free)."""
        return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most bytes of host memory the slots held at once since the pool was made."""
        return self._peak

    def acquire(self, slot_bytes: int, grad_bytes: int | Sequence[int], block: bool,
                timeout: float | None = None, *, lend: bool = False) -> Slot | None:
        """A slot with at least ``slot_bytes`` of data and ``grad_bytes`` per gradient buffer (an
        int: both; a pair: per turn), held once more; or None when none is free and ``block`` is
        False or none was freed within ``timeout`` seconds (None: without bound).

        With ``lend``, a slot a persist is still reading may be borrowed when none is free (its
        ``drain`` says which bytes are not yet free; ``refs`` then counts both). Slots too small
        for a grown layout are dropped and reallocated, to the larger of the old and the new
        size of each buffer when that stays within ``max_bytes``.
        """
        want = [slot_bytes, *_grad_sizes(grad_bytes)]
        deadline = None if timeout is None else monotonic() + timeout
        keep: torch.Tensor | None = None  # the data buffer of a dropped slot, if large enough
        keep_held: HeldTensors | None = None  # and what it holds (frozen_copy="when_changed")
        with self._cv:
            while True:
                grown = list(want)
                while self._free:
                    s = self._free.pop()
                    if s.fits(slot_bytes, grad_bytes) or (
                            s.data.numel() >= slot_bytes
                            and self._grow_grads(s, _grad_sizes(grad_bytes))):
                        self._trim_grads(s, _grad_sizes(grad_bytes))
                        s.refs = 1
                        return s
                    self._count -= 1
                    self._bytes -= s.nbytes
                    old = [s.data.numel(), *(g.numel() for g in s.grads)]
                    grown = [max(a, b) for a, b in zip(grown, old, strict=True)]
                    # Gradient buffers grow by half at least, as in _grow_grads.
                    grown[1:] = [_headroom(w, o) for w, o in zip(grown[1:], old[1:], strict=True)]
                    if keep is None or s.data.numel() > keep.numel():
                        keep, keep_held = s.data, s.held
                    s = None  # type: ignore[assignment]  # its other buffers are freed now
                sizes = grown if self._fits(sum(grown)) else want
                if keep is not None and sizes[0] <= keep.numel() and self._fits(sum(sizes) - sizes[0] + keep.numel()):
                    sizes[0] = keep.numel()
                else:
                    keep = None
                if self._count < self._max and self._fits(sum(sizes)):
                    self._count += 1
                    self._bytes += sum(sizes)
                    self._peak = max(self._peak, self._bytes)
                    break
                if lend:
                    lent = self._lend(slot_bytes, grad_bytes)
                    if lent is not None:
                        return lent
                keep = None  # not counted while waiting: let it go
                left = None if deadline is None else deadline - monotonic()
                if not block or (left is not None and left <= 0):
                    return None
                self._cv.wait(left)
        try:
            # What a kept buffer holds goes with it, and only with it: a new buffer holds nothing.
            slot = Slot(sizes[0], sizes[1:], self._pin, data=keep,
                        held=keep_held if keep is not None else None)
        except BaseException:
            with self._cv:
                self._count -= 1
                self._bytes -= sum(sizes)
                self._cv.notify()
            raise
        slot.refs = 1
        return slot

    def _lend(self, slot_bytes: int, grad_bytes: int | Sequence[int]) -> Slot | None:
        """A slot one persist alone still reads, for a borrower (under the lock). Its gradient
        buffers, which that persist no longer uses, grow to the borrower's sizes if needed."""
        need = _grad_sizes(grad_bytes)
        for s in self._draining:
            d = s.drain
            if d is None or d.lent or s.refs != 1 or s.data.numel() < slot_bytes:
                continue
            if not self._grow_grads(s, need):
                continue
            d.lent = True
            s.refs += 1
            return s
        return None

    def _grow_grads(self, s: Slot, need: tuple[int, int]) -> bool:
        """Grow ``s``'s gradient buffers that are smaller than ``need`` (bytes per turn), in
        place, under the lock; its data buffer, and what it holds, stay. Each grows by half at
        least where that fits within ``max_bytes``, else to ``need`` exactly. Plans ask for a
        little more each save as K and the blocks move: at exact sizes every save paid a new
        pinned buffer, 0.1-0.2 s per 300 MB on the training thread (``cudaHostRegister``,
        measured on an H200). False, nothing changed, where even ``need`` does not fit."""
        for sizes in ([_headroom(n, g.numel()) for g, n in zip(s.grads, need, strict=True)],
                      list(need)):
            grow = sum(max(0, n - g.numel()) for g, n in zip(s.grads, sizes, strict=True))
            if self._fits(grow):
                break
        else:
            return False
        for t, n in enumerate(sizes):
            if s.grads[t].numel() < n:
                self._bytes += n - s.grads[t].numel()
                s.grads[t] = host_empty(n, pin_memory=self._pin)
                s.fresh = True
                s.grad_view_cache = None  # its views would keep the old buffer alive
        self._peak = max(self._peak, self._bytes)
        return True

    def _trim_grads(self, s: Slot, need: tuple[int, int]) -> None:
        """Free each gradient buffer of ``s`` (free, under the lock) that this acquisition
        (``need``: bytes per turn) and the ones just before it needed none of
        (:data:`GRAD_IDLE_ACQUIRES` in a row); any need starts the count again."""
        for t, n in enumerate(need):
            if n > 0 or s.grads[t].numel() == 0:
                s.grad_idle[t] = 0
                continue
            s.grad_idle[t] += 1
            if s.grad_idle[t] >= GRAD_IDLE_ACQUIRES:
                self._bytes -= s.grads[t].numel()
                s.grads[t] = host_empty(0, pin_memory=self._pin)
                s.grad_idle[t] = 0
                s.grad_view_cache = None  # its views would keep the freed buffer alive
                self._cv.notify_all()  # a request waiting for room under max_bytes may fit now

    def _fits(self, nbytes: int) -> bool:
        return self._max_bytes is None or self._bytes + nbytes <= self._max_bytes

    def make_lendable(self, slot: Slot, drain: Drain) -> bool:
        """Let one save borrow ``slot`` while its only holder's persist reads it (``drain``);
        False (not lendable) when another save holds it too, or an earlier persist that made it
        lendable still has bytes to read."""
        with self._cv:
            if slot.refs != 1 or (slot.drain is not None and not slot.drain.done):
                return False
            slot.drain = drain
            self._drains.append(drain)
            if slot not in self._draining:
                self._draining.append(slot)
            self._cv.notify_all()
            return True

    def end_lending(self, slot: Slot, drain: Drain) -> None:
        """The persist that made ``slot`` lendable with ``drain`` reads nothing more: every
        byte is free. ``drain.lent`` stays (the lender's snapshot stays unshareable)."""
        with self._cv:
            drain.finish()
            if slot.drain is drain:
                slot.drain = None
                if slot in self._draining:
                    self._draining.remove(slot)

    @property
    def last_drain_pace(self) -> tuple[int, float]:
        """``(bytes, seconds)`` (:meth:`Drain.pace`) of the latest persist of a lendable slot
        that has written all of it, or ended (one of the latest 8); ``(0, 0.0)`` before any."""
        with self._cv:
            for d in reversed(self._drains):
                if d.done and (pace := d.pace())[0]:
                    return pace
            return 0, 0.0

    def share(self, slot: Slot) -> bool:
        """Hold ``slot`` once more (a save sharing another's snapshot); False when it was
        already released by every save (it may be reused: take another). A slot shared is not
        lent from then on (its persist is no longer its only reader); the caller must not share
        the snapshot of a save whose slot was lent (:func:`gockpt._record.find_leader`): the
        borrower overwrites it."""
        with self._cv:
            if slot.refs <= 0:
                return False
            if slot.drain is not None and not slot.drain.lent and slot in self._draining:
                self._draining.remove(slot)
            slot.refs += 1
            return True

    def release(self, slot: Slot) -> None:
        """Drop one hold of ``slot``; the last one returns it for reuse and wakes one waiting
        request."""
        with self._cv:
            if slot.refs <= 0:
                # A slot returned twice would be handed to two saves at once.
                raise RuntimeError("gockpt: a host snapshot slot was released more often than held")
            slot.refs -= 1
            if slot.refs > 0:
                return
            if slot in self._draining:  # its persist read everything: no lending from now on
                self._draining.remove(slot)
            slot.drain = None
            self._free.append(slot)
            self._cv.notify()
