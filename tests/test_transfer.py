"""Transfer: gradient copies overtake state copies; the host pool applies back-pressure."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from gockpt.transfer import PRIORITY_GRAD, PRIORITY_STATE, CpuCopier, SlotPool


def test_copies_are_exact_and_chunked():
    c = CpuCopier(chunk_bytes=4096)
    src = [torch.randn(1000), torch.randint(0, 100, (3, 7), dtype=torch.int64), torch.randn(0)]
    dst = [torch.empty_like(s) for s in src]
    c.copy(list(zip(src, dst, strict=True)), PRIORITY_STATE).wait()
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    c.close()


def test_small_tensors_are_copied_together_and_large_ones_in_slices():
    # Chunks of at most 4096 bytes: runs of small tensors share one copy call, a tensor of a
    # chunk or more is sliced, and every byte lands where it belongs (mixed dtypes, an empty
    # tensor, a non-contiguous source, sizes across each boundary).
    c = CpuCopier(chunk_bytes=4096)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g) for n in (1, 7, 300, 723, 1023, 1024, 1025, 0, 5000, 3)]
    src += [torch.randint(0, 255, (4095,), dtype=torch.uint8, generator=g),
            torch.randn(64, 64, generator=g).t(), torch.randn(2, generator=g).to(torch.bfloat16)]
    dst = [torch.full(s.shape, 7, dtype=s.dtype) for s in src]
    pairs = list(zip(src, dst, strict=True))
    chunks = list(c._chunks(pairs))
    assert all(sum(d.numel() * d.element_size() for d in ds) <= 4096 for _, ds in chunks)
    one_per_tensor = sum(max(1, -(-s.numel() * s.element_size() // 4096)) for s in src)
    assert any(len(ds) > 1 for _, ds in chunks) and len(chunks) < one_per_tensor
    ticket = c.copy(pairs, PRIORITY_STATE)
    ticket.wait()
    assert ticket.done_at is not None
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    # Bytes, not elements (small tensors are copied in their own shape and dtype).
    assert c.bytes_copied == ticket.nbytes == sum(s.numel() * s.element_size() for s in src)
    c.close()


def test_a_source_that_requires_grad_is_copied_outside_autograd():
    # Small ones together in one call, a large one in slices, one alone.
    c = CpuCopier(chunk_bytes=4096)
    src = [torch.randn(10, requires_grad=True), torch.randn(20, requires_grad=True),
           torch.randn(3000, requires_grad=True), torch.randn(1000, requires_grad=True)]
    dst = [torch.zeros(s.shape) for s in src]
    pairs = list(zip(src, dst, strict=True))
    assert len(list(c._chunks(pairs))[0][0]) == 2
    c.copy(pairs, PRIORITY_STATE).wait()
    assert all(torch.equal(a.detach(), b) for a, b in zip(src, dst, strict=True))
    assert not any(d.requires_grad or d.grad_fn is not None for d in dst)
    c.close()


def test_a_destination_of_another_shape_or_dtype_gets_the_bytes():
    # Same bytes, other layout: a flat host buffer for a (4, 5) tensor, and bytes for floats,
    # in a chunk with tensors copied as they are.
    c = CpuCopier(chunk_bytes=4096)
    a, b, e = torch.randn(4, 5), torch.randn(6), torch.randn(3)
    pairs = [(a, torch.zeros(20)), (b, torch.zeros(24, dtype=torch.uint8)), (e, torch.zeros(3))]
    assert len(list(c._chunks(pairs))) == 1
    c.copy(pairs, PRIORITY_STATE).wait()
    assert torch.equal(pairs[0][1], a.reshape(-1))
    assert torch.equal(pairs[1][1].view(torch.float32), b)
    assert torch.equal(pairs[2][1], e)
    assert c.bytes_copied == 80 + 24 + 12
    c.close()


def test_gradient_job_overtakes_queued_state_job():
    # The emulated slow link makes the state job many chunks long; the gradient job queued
    # after it must finish first (GoCkpt §4.2.2).
    c = CpuCopier(chunk_bytes=4096, bytes_per_s=2e6)
    big = torch.randn(200 * 1024)  # 800 KiB = 200 chunks, ~0.4 s on the emulated link
    state = c.copy([(big, torch.empty_like(big))], PRIORITY_STATE)
    g = torch.randn(16)
    grad = c.copy([(g, torch.empty_like(g))], PRIORITY_GRAD)
    grad.wait()
    assert not state.done()
    state.wait()
    c.close()


def test_copy_error_reaches_the_waiter():
    c = CpuCopier(chunk_bytes=4096)
    t = c.copy([(torch.randn(10), torch.empty(10, dtype=torch.float64))], PRIORITY_STATE)
    try:
        t.wait()
    except RuntimeError:
        pass
    else:
        raise AssertionError("a size mismatch must fail the copy")
    c.close()


def test_slot_pool_is_bounded_and_reuses_buffers():
    pool = SlotPool(max_slots=1, pin=False)
    a = pool.acquire(1024, 64, block=False)
    assert a is not None and pool.acquire(1024, 64, block=False) is None
    got = []
    started = threading.Event()

    def waiter():
        started.set()
        got.append(pool.acquire(512, 0, block=True))

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    assert not got  # blocked: no free slot
    pool.release(a)
    t.join(10)
    assert got == [a]  # the same buffers, not a new allocation


def test_a_drain_frees_a_range_once_every_pending_range_over_it_is_read():
    from gockpt.transfer import Drain

    d = Drain([[(0, 100), (100, 200), (300, 400)]])
    assert d.wait_free([(200, 300)], 0.0)  # never read by the persist: free at once
    assert not d.wait_free([(150, 160)], 0.05)
    d.read(100, 200)
    assert d.wait_free([(150, 160), (100, 200)], 0.0)
    assert not d.wait_free([(0, 1)], 0.0) and not d.wait_free([(399, 500)], 0.0)
    freed = threading.Event()
    t = threading.Thread(target=lambda: d.wait_free([(0, 400)], 10.0) and freed.set())
    t.start()
    d.read(0, 100)
    assert not freed.wait(0.05)
    d.finish()  # the persist ended (here: failed): it reads nothing more
    t.join(10)
    assert freed.is_set() and d.done


def test_a_drain_counts_the_bytes_written_before_each_group_of_ranges_is_free():
    from gockpt.transfer import Drain

    # One io thread: the files in the order given, each in its own order.
    d = Drain([[(300, 400), (400, 450)], [(0, 100), (100, 200)]])
    assert d.pace() == (0, 0.0)  # nothing written yet: no pace
    # Per group, cumulative: bytes written before every pending range overlapping any range
    # given so far is written; a range no pending one overlaps adds nothing.
    assert d.pending_through([[(350, 360)], [(200, 300)], [(0, 10)], [(150, 160)]]) == [100, 100, 250, 350]
    d.read(300, 400)
    assert d.pending_through([[(0, 10)], [(420, 421)], [(300, 301)]]) == [150, 150, 150]
    nbytes, seconds = d.pace()
    assert nbytes == 100 and seconds > 0
    d.finish()
    assert d.pending_through([[(0, 450)]]) == [0]
    # Done: timed to its last range (before the earlier reading, which ran to then), and
    # still at that pace later.
    done = d.pace()
    assert done[0] == nbytes and 0 < done[1] <= seconds
    time.sleep(0.01)
    assert d.pace() == done


def test_a_drain_with_several_threads_shares_the_pace_between_the_files_in_progress():
    from gockpt.transfer import Drain

    # Two threads, three files of 100, 100 and 50 bytes: the first two are written side by
    # side, each at half the pace; the third starts once one of them ends.
    d = Drain([[(0, 50), (50, 100)], [(100, 200)], [(200, 250)]], threads=2)
    assert d.pending_through([[(0, 1)], [(60, 61)], [(100, 101)], [(200, 250)]]) == [100, 200, 200, 250]
    # All of it: every byte, whatever the order (the threads share one pace).
    assert Drain([[(0, 100)], [(100, 200)], [(200, 250)]], threads=3).pending_through([[(0, 250)]]) == [250]


def test_a_slot_is_lent_once_to_one_borrower_while_its_persist_alone_reads_it():
    from gockpt.transfer import Drain

    pool = SlotPool(max_slots=1, pin=False)
    a = pool.acquire(1024, 0, block=False)
    assert pool.acquire(1024, 0, block=False, lend=True) is None  # nothing is being persisted
    drain = Drain([[(0, 1024)]])
    assert pool.make_lendable(a, drain)
    b = pool.acquire(1024, 0, block=False, lend=True)
    assert b is a and a.refs == 2 and drain.lent
    assert pool.acquire(1024, 0, block=False, lend=True) is None  # lent once only
    pool.release(a)  # the persist's early release: the borrower still holds it
    drain.read(0, 1024)
    pool.end_lending(a, drain)
    assert a.refs == 1 and a.drain is None and drain.done and drain.lent
    assert pool.last_drain_pace == drain.pace() and pool.last_drain_pace[0] == 1024
    again = Drain([[(0, 10)]])
    assert pool.make_lendable(a, again)  # the borrower's own persist may lend it on
    pool.end_lending(a, again)
    pool.release(a)
    assert pool.acquire(1024, 0, block=False) is a and pool.num_slots == 1


def test_a_shared_slot_is_not_lent_while_the_sharer_still_has_to_read_it():
    """A save sharing the lender's snapshot reads the slot after the lender's own persist has
    read it all and released it: no borrower may overwrite it before that."""
    from gockpt.transfer import Drain

    pool = SlotPool(max_slots=1, pin=False)
    a = pool.acquire(1024, 0, block=False)
    drain = Drain([[(0, 512), (512, 1024)]])
    assert pool.make_lendable(a, drain)
    assert pool.share(a)  # a follower joins the lender's snapshot
    drain.read(0, 512)
    drain.read(512, 1024)
    pool.release(a)  # the lender read everything: the follower alone holds it now
    assert a.refs == 1
    assert pool.acquire(1024, 0, block=False, lend=True) is None
    pool.end_lending(a, drain)
    pool.release(a)
    assert pool.acquire(1024, 0, block=False, lend=True) is a and a.drain is None


def test_drain_skip_frees_a_range_without_counting_it_in_the_pace():
    """A linked file's ranges are free at once, but no write took their time: the pace a
    borrower's wait is predicted from counts only what was written."""
    from gockpt.transfer import Drain

    d = Drain([[(0, 100)], [(100, 300)]])
    d.skip(0, 100)
    assert d.pace() == (0, 0.0)
    assert d.wait_free([(0, 100)], timeout_s=0.0)
    assert not d.wait_free([(100, 300)], timeout_s=0.0)
    d.read(100, 300)
    assert d.pace()[0] == 200 and d.done


def test_copy_tensors_copies_every_pair_bit_for_bit_outside_autograd():
    from gockpt.transfer import copy_tensors

    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    strided = torch.randn(4, 6, generator=g).t()  # not contiguous
    half = torch.randn(7, generator=g).to(torch.bfloat16)
    step = torch.tensor(12.0)
    srcs = [param, strided, half, step]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    copy_tensors(dsts, srcs, non_blocking=True)
    def bits(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(bits(d), bits(s))
        assert d.grad_fn is None and not d.requires_grad
    copy_tensors([], [], non_blocking=False)  # nothing to copy: no error


def test_copy_tensors_falls_back_to_one_copy_per_pair_where_the_foreach_op_refuses(monkeypatch):
    from gockpt.transfer import copy_tensors

    def refuse(*_args, **_kwargs):
        raise RuntimeError("refused")

    monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    srcs = [torch.arange(6.0), torch.arange(4, dtype=torch.int64)]
    dsts = [torch.zeros(6), torch.zeros(4, dtype=torch.int64)]
    copy_tensors(dsts, srcs, non_blocking=False)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts, strict=True))
    with pytest.raises(RuntimeError):  # a mismatch the per-tensor path refuses too
        copy_tensors([torch.zeros(4)], [torch.zeros(3)], non_blocking=False)


def test_gradient_buffers_grow_in_place_by_half_and_are_not_reallocated_for_small_increases():
    # Plans ask for a little more gradient room at each save; a new pinned buffer costs 0.1-0.2
    # s per 300 MB on a GPU host, so a growing buffer grows by half and the data buffer stays.
    pool = SlotPool(max_slots=1, pin=False)
    s = pool.acquire(4096, (1000, 800), block=False)
    data, held = s.data, s.held
    pool.release(s)
    s2 = pool.acquire(4096, (1100, 800), block=False)  # the first buffer is too small
    assert s2 is s and s.data is data and s.held is held
    assert [g.numel() for g in s.grads] == [1500, 800] and pool.bytes == 4096 + 2300
    first = s.grads[0]
    pool.release(s)
    s3 = pool.acquire(4096, (1400, 700), block=False)  # within the headroom: no new buffer
    assert s3 is s and s.grads[0] is first and [g.numel() for g in s.grads] == [1500, 800]
    pool.release(s)
    assert pool.peak_bytes == 4096 + 2300


def test_gradient_buffers_grow_exactly_where_the_headroom_would_pass_the_bound():
    pool = SlotPool(max_slots=1, pin=False, max_bytes=4096 + 2000)
    s = pool.acquire(4096, (1000, 800), block=False)
    pool.release(s)
    s2 = pool.acquire(4096, (1100, 800), block=False)  # 1500 would pass max_bytes; 1100 fits
    assert s2 is s and [g.numel() for g in s.grads] == [1100, 800] and pool.bytes <= 6096
    pool.release(s)
    assert pool.acquire(4096, (1300, 800), block=False) is None  # fits no way: no slot


def test_copies_that_overlap_on_two_streams_count_their_shared_time_once():
    from gockpt.transfer import busy_union_ms

    # A gradient job (0-10 ms) and a state job (4-12 ms) share the link: 12 ms busy, not 18.
    assert busy_union_ms([(4.0, 12.0), (0.0, 10.0)], -math.inf) == (12.0, 12.0)
    # Apart, each counts whole; nested, the inner one adds nothing.
    assert busy_union_ms([(0.0, 2.0), (5.0, 6.0)], -math.inf) == (3.0, 6.0)
    assert busy_union_ms([(0.0, 10.0), (2.0, 3.0)], -math.inf) == (10.0, 10.0)
    # Read on a later call: a job that began before what was counted adds only its time after.
    busy, covered = busy_union_ms([(0.0, 10.0)], -math.inf)
    assert busy_union_ms([(8.0, 15.0), (20.0, 21.0)], covered) == (6.0, 21.0)
    assert busy_union_ms([], 21.0) == (0.0, 21.0)


def test_the_cuda_pace_reads_overlapping_jobs_once_and_keeps_a_recent_reference():
    # CudaCopier.rate_sample with stand-in events (a clock in ms; no GPU here): jobs read in
    # the order issued, their union counted, and while jobs stay pending the reference moves
    # to the end of the last job read, so elapsed times stay small on long runs.
    from collections import deque

    from gockpt.transfer import CudaCopier

    class Event:
        def __init__(self, t: float) -> None:
            self.t, self.ended = t, False

        def query(self) -> bool:
            return self.ended

        def elapsed_time(self, other: "Event") -> float:
            assert self.ended and other.ended
            return other.t - self.t

    ref = Event(0.0)
    a = (Event(0.0), Event(10.0), 100)    # gradient stream
    b = (Event(4.0), Event(30.0), 200)    # state stream, overlapping a
    c = (Event(12.0), Event(14.0), 50)    # gradient stream, inside b
    copier = object.__new__(CudaCopier)
    copier._ref, copier._covered_ms = ref, -math.inf
    copier._pending, copier._timed_bytes, copier.busy_s = deque([a, b, c]), 0, 0.0
    for e in (ref, *a[:2], c[0], c[1]):
        e.ended = True  # a and c ended; b still running
    assert copier.rate_sample() == (100, pytest.approx(0.010))
    assert copier._ref is a[1] and len(copier._pending) == 2  # c waits behind b
    d = (Event(32.0), Event(40.0), 10)
    copier._pending.append(d)
    b[0].ended = b[1].ended = d[0].ended = True
    # b (4-30) counts 20 ms past a's end, c nothing (inside b); d still running.
    assert copier.rate_sample() == (350, pytest.approx(0.030))
    assert copier._ref is c[1]
    d[1].ended = True
    assert copier.rate_sample() == (360, pytest.approx(0.038))
    assert copier._ref is None and not copier._pending  # a fresh reference for the next job


def test_a_cuda_ticket_is_torn_by_a_write_queued_before_the_host_saw_its_copy_end():
    # CopyTicket with a stand-in event (no GPU here). On CUDA a write queued on the compute
    # stream after the copy was queued is unordered against it: one queued before the host saw
    # the copy's event complete may have landed during the copy (torn); one queued after it
    # cannot have. A source freed meanwhile was not written.
    import gc

    from gockpt.errors import CheckpointTornError
    from gockpt.transfer import CopyTicket

    class Event:
        ended = False

        def query(self) -> bool:
            return self.ended

        def synchronize(self) -> None:
            self.ended = True

    def ticket(*sources):
        t = CopyTicket(8, Event())
        t.watch_sources(list(sources))
        return t

    g = torch.zeros(2)
    early = ticket(g)
    g.zero_()  # before the host saw the copy end
    with pytest.raises(CheckpointTornError, match="modified in place"):
        early.wait()
    with pytest.raises(CheckpointTornError):
        early.wait()  # the error stays

    late = ticket(g)
    assert not late.done()
    late._cuda_event.ended = True
    assert late.done()  # seen ended with the version unchanged: clean
    g.zero_()  # queued after: ordered behind the copy
    late.wait()

    waited = ticket(g)
    waited.wait()  # the guards wait before letting a write through
    g.zero_()
    waited.wait()

    freed = ticket(torch.zeros(2))  # a gradient set to None: nothing can write it
    gc.collect()
    freed.wait()
