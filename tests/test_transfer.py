"""Transfer: gradient copies overtake state copies; the host pool applies back-pressure."""

from __future__ import annotations

import threading

import torch

from gockpt.transfer import PRIORITY_GRAD, PRIORITY_STATE, CpuCopier, SlotPool


def test_copies_are_exact_and_chunked():
    c = CpuCopier(chunk_bytes=4096)
    src = [torch.randn(1000), torch.randint(0, 100, (3, 7), dtype=torch.int64), torch.randn(0)]
    dst = [torch.empty_like(s) for s in src]
    c.copy(list(zip(src, dst, strict=True)), PRIORITY_STATE).wait()
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
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
