"""The CUDA path (copy stream, events, pinned memory). Runs only where a GPU is present."""

from __future__ import annotations

import pytest
import torch

import gockpt
from gockpt import Engine, GoCkptConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _train(model, opt, steps, on_step_end):
    g = torch.Generator(device="cuda").manual_seed(0)
    for it in range(steps):
        x = torch.randn(64, 256, device="cuda", generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        on_step_end(it)


def _assert_matches(m, live: dict, mode: str) -> None:
    """The checkpoint of metrics ``m`` holds the live state of its captured step: bit for bit
    where nothing was replayed or the replay is exact, else within the self-check's bound."""
    state = gockpt.load_checkpoint(m.path)
    replay = state.manifest["meta"].get("replay", {})
    for k, v in live[state.captured_step].items():
        got = state.model_state_dict[k]
        if mode in ("sync", "async", "lazy") or replay.get("exact"):
            assert torch.equal(got, v), (m.path, k)
        else:
            # CPU replay of a CUDA optimizer: bounded by the self-check's recorded error per step.
            bound = 4 * max(replay.get("max_abs_error", 0.0), 1e-7) * m.num_overlap_steps
            assert (got - v).abs().max().item() <= bound, (m.path, k)


@pytest.mark.parametrize("mode", ["sync", "async", "lazy", "gockpt", "gockpt_o"])
def test_cuda_checkpoint_matches_live_state(tmp_path, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    live, handles = {}, []

    def on_step_end(it):
        eng.step_end()
        live.setdefault(eng.version, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        if it == 3:
            handles.append(eng.save(str(tmp_path / "ck")))

    _train(model, opt, 10, on_step_end)
    eng.close()
    _assert_matches(handles[0].result(), live, mode)


@pytest.mark.parametrize("mode", ["lazy", "gockpt_o"])
def test_cuda_saves_sharing_a_snapshot_wait_for_its_last_copy(tmp_path, mode):
    """Two saves at one step share one pinned snapshot; the second one's files are written only
    after the first one's last device-to-host copy has landed (both equal at the captured step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # replayed exactly where the self-check says
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=2, max_overlap_steps=2))
    live, handles = {}, []

    def on_step_end(it):
        eng.step_end()
        live.setdefault(eng.version, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        if it == 3:
            handles.append(eng.save(str(tmp_path / "a")))
            handles.append(eng.save(str(tmp_path / "b")))

    _train(model, opt, 8, on_step_end)
    eng.close()
    a, b = (h.result() for h in handles)
    assert b.host_shared and a.captured_step == b.captured_step
    for m in (a, b):
        _assert_matches(m, live, mode)


def test_cuda_an_edit_after_the_capture_fails_every_save_sharing_the_snapshot(tmp_path):
    """A write through ``.data`` right after two saves at one step (Lightning's top-k and
    last.ckpt share a snapshot) races the copy of their block: on CUDA the sampled check is read
    back at the persist, and it must fail the second save as it fails the first, never write
    it from the torn snapshot. Each save is either refused as torn or equal to the state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(4))).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))
    x = torch.randn(8, 4096, device="cuda")

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()

    for _ in range(3):
        step()
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handles = [eng.save(str(tmp_path / "a")), eng.save(str(tmp_path / "b"))]
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(1.0)
    step()
    eng.close()
    for h in handles:
        try:
            m = h.result()
        except gockpt.CheckpointTornError:
            continue
        got = gockpt.load_checkpoint(m.path).model_state_dict
        for k, v in want.items():
            assert torch.equal(got[k], v), (m.path, k)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_a_model_on_two_devices_is_refused_at_the_start():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to("cuda:0"), torch.nn.Linear(8, 8).to("cuda:1"))
    with pytest.raises(ValueError, match="2 CUDA devices"):
        Engine(model, torch.optim.AdamW(model.parameters()))


def test_pinned_host_buffers_hold_their_size_not_the_next_power_of_two():
    """torch's caching host allocator rounds a pinned allocation up to a power of two; the host
    snapshot and gradient buffers are allocated and page-locked at their own size, usable as the
    destination of a non-blocking D2H copy, and given back when dropped (that they are
    unregistered first: ``tests/test_direct.py``)."""
    import gc

    import psutil

    from gockpt._direct import aligned_empty

    torch.cuda.init()
    proc = psutil.Process()
    n = (1 << 28) + (1 << 20)  # 257 MiB: 512 MiB if rounded
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    gc.collect()
    before = proc.memory_info().rss
    buf = aligned_empty(n, pin_memory=True)
    grown = proc.memory_info().rss - before
    assert buf.numel() == n and buf.is_pinned() and buf.data_ptr() % 4096 == 0
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, src.cpu())
    del buf
    gc.collect()
    freed = proc.memory_info().rss - before

    # torch's caching allocator for comparison, from an empty host cache (a cached free block
    # would be reused and show no growth).
    empty_host_cache = getattr(torch._C, "_host_emptyCache", lambda: None)
    empty_host_cache()
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    ref_grown = proc.memory_info().rss - before - freed
    del ref
    empty_host_cache()
    # RSS sees page-locked pages at all (else the bound below could not fail) ...
    assert ref_grown >= 0.9 * n, ref_grown
    # ... and ours hold about their own size, and are released.
    assert grown <= 1.1 * n, (grown, ref_grown)
    assert freed <= 0.1 * n, freed


def test_cuda_copier_times_its_copies_on_the_device_and_the_probe_agrees():
    """The copy's pace is read from events on its stream (the host cannot time a queued copy),
    and the probe the first plan uses reads about the same pace: on an H200 it once read
    several times the link's, so a copy of three steps was planned into one."""
    from gockpt._planner import probe_copy_bandwidth
    from gockpt._direct import aligned_empty
    from gockpt.transfer import PRIORITY_STATE, CudaCopier

    c = CudaCopier(torch.device("cuda"), 1 << 22)
    n = 256 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = aligned_empty(n, pin_memory=True)
    assert c.rate_sample() == (0, 0.0)
    for _ in range(3):
        c.copy([(src, dst)], PRIORITY_STATE).wait()
    done, seconds = c.rate_sample()
    assert done == 3 * n and seconds > 0
    pace = done / seconds
    assert 1e8 < pace < 1e12, pace  # bytes/s: between a slow PCIe link and any host memory
    assert torch.equal(dst, src.cpu())
    probed = probe_copy_bandwidth(c, torch.device("cuda"), None)
    assert 0.2 * pace < probed < 2.0 * pace, (probed, pace)
    c.close()


def test_cuda_copies_on_both_streams_at_once_read_the_links_pace():
    """A gradient job and a state job that run together share the link; their common time is
    counted once, so the pace read is the link's, as with one stream at a time (summing each
    job's own time read it up to half as fast, and the planner then saw a slower link)."""
    from gockpt._direct import aligned_empty
    from gockpt.transfer import PRIORITY_GRAD, PRIORITY_STATE, CudaCopier

    n = 256 << 20
    src = torch.randint(0, 256, (2, n), dtype=torch.uint8, device="cuda")
    dst = [aligned_empty(n, pin_memory=True) for _ in range(2)]
    alone = CudaCopier(torch.device("cuda"), 1 << 22)
    alone.copy([(src[0], dst[0])], PRIORITY_STATE).wait()  # warm-up, read and left out
    done0, seconds0 = alone.rate_sample()
    for _ in range(3):
        alone.copy([(src[0], dst[0])], PRIORITY_STATE).wait()
    done, seconds = alone.rate_sample()
    pace_alone = (done - done0) / (seconds - seconds0)
    both = CudaCopier(torch.device("cuda"), 1 << 22)
    for _ in range(3):
        torch.cuda.synchronize()
        tickets = [both.copy([(src[0], dst[0])], PRIORITY_STATE),
                   both.copy([(src[1], dst[1])], PRIORITY_GRAD)]
        for t in tickets:
            t.wait()
    done, seconds = both.rate_sample()
    assert done == 6 * n
    # Summing each job's time read 0.5x (a shared link) to 0.67x (one after the other).
    assert 0.85 * pace_alone < done / seconds < 1.6 * pace_alone, (done / seconds, pace_alone)
    assert torch.equal(dst[1], src[1].cpu())
    alone.close()
    both.close()


def test_cuda_device_wait_at_a_window_end_is_timed_and_zero_for_an_ended_copy():
    """A fence on a copy still running makes the compute stream wait on the device: the wait is
    timed with events (``CheckpointMetrics.device_wait_s``); a copy that has ended costs none."""
    from gockpt._direct import aligned_empty
    from gockpt.transfer import PRIORITY_STATE, CudaCopier

    c = CudaCopier(torch.device("cuda"), 1 << 22)
    n = 512 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = aligned_empty(n, pin_memory=True)
    torch.cuda.synchronize()
    running = c.copy([(src, dst)], PRIORITY_STATE)
    running.fence_compute()  # 512 MiB over a host link: still running
    torch.cuda.synchronize()
    waited = running.device_wait_s()
    _, seconds = c.rate_sample()
    assert 0.0 < waited <= seconds * 1.05 + 1e-3, (waited, seconds)
    ended = c.copy([(src, dst)], PRIORITY_STATE)
    ended.wait()
    ended.fence_compute()
    assert ended.device_wait_s() == 0.0
    c.close()


def test_cuda_copier_issues_many_tensors_of_mixed_dtypes_into_pinned_views_exactly():
    """One job of many small tensors (parameters, bf16 weights, an int64 count, a host scalar)
    is issued in one foreach call, device to pinned host: every byte lands where it belongs."""
    from gockpt._direct import aligned_empty
    from gockpt.transfer import PRIORITY_STATE, CudaCopier

    c = CudaCopier(torch.device("cuda"), 1 << 22)
    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g)) for n in (1, 7, 1000)]
    srcs += [torch.randn(33, 5, device="cuda", generator=g).to(torch.bfloat16).t(),
             torch.arange(9, device="cuda", dtype=torch.int64), torch.tensor(3.0)]
    sizes = [s.numel() * s.element_size() for s in srcs]
    buf = aligned_empty(sum(-(-n // 64) * 64 for n in sizes), pin_memory=True)
    dsts, off = [], 0
    for s, n in zip(srcs, sizes, strict=True):  # each view at a 64-byte boundary, as a slot's
        dsts.append(buf[off:off + n].view(s.dtype).view(s.shape))
        off += -(-n // 64) * 64
    c.copy(list(zip(srcs, dsts, strict=True)), PRIORITY_STATE).wait()
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(d, s.detach().cpu()) and d.grad_fn is None
    c.close()


def test_cuda_gradients_zeroed_in_place_right_after_the_update_never_make_a_torn_checkpoint(tmp_path):
    # gockpt_o copies an update's gradients on a copy stream while the loop goes on;
    # module.zero_grad(set_to_none=False) right after the update queues a zeroing kernel on
    # the compute stream, unordered against that copy (no guard sees it). Each checkpoint
    # either holds the live state of its captured step or fails (torn), never raising into the
    # loop; after a torn copy later checkpoints wait for their gradient copies and hold.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3))
    g = torch.Generator(device="cuda").manual_seed(0)
    live, handles = {}, []
    for it in range(16):
        model(torch.randn(64, 2048, device="cuda", generator=g)).pow(2).mean().backward()
        opt.step()
        model.zero_grad(set_to_none=False)
        eng.step_end()
        live.setdefault(eng.version, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        if it in (1, 6, 11):
            handles.append(eng.save(str(tmp_path / f"ck{it}")))
    eng.close()
    torn = 0
    for h in handles:
        try:
            m = h.result()
        except gockpt.CheckpointTornError:
            torn += 1
            continue
        _assert_matches(m, live, m.mode)
    assert torn <= 1  # the first torn copy switches later saves to waiting for their copies
