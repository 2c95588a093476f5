"""Background work: the persist threads' priority (``io_nice``) and the phase timeline."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from _loop import assert_state_equal, make, snapshot, train

import gockpt
from gockpt import Engine, GoCkptConfig, _trace
from gockpt.persist import lower_thread_priority, persist
from gockpt.targets import LocalTarget

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")

_PATH = Path(__file__).resolve().parents[1] / "examples" / "bench_timeline.py"
_spec = importlib.util.spec_from_file_location("gockpt_bench_timeline", _PATH)
bench_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_timeline)


def _nice(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())


@pytest.mark.parametrize("value", [-1, 20, True, 1.5, "5"])
def test_io_nice_out_of_range_is_rejected_by_name(value):
    with pytest.raises(ValueError, match="io_nice"):
        GoCkptConfig(io_nice=value)


def test_io_nice_default_changes_nothing():
    assert GoCkptConfig().io_nice is None


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@linux_only
def test_lower_thread_priority_lowers_only_the_calling_thread():
    base = _nice()

    def lowered_twice() -> int:
        lower_thread_priority(3)
        lower_thread_priority(3)  # the process's niceness + 3, not + 6
        return _nice()

    assert _in_thread(lowered_twice) == min(19, base + 3)
    assert _nice() == base
    assert _in_thread(lambda: (lower_thread_priority(None), _nice())[1]) == base
    assert _in_thread(lambda: (lower_thread_priority(0), _nice())[1]) == base
    assert _in_thread(lambda: (lower_thread_priority(19), _nice())[1]) == 19


def _writer_niceness(monkeypatch) -> list[int]:
    """The niceness of each thread that writes a file through the local storage target."""
    seen: list[int] = []
    write = LocalTarget.write

    def spy(self, name, pieces, check):
        seen.append(_nice())
        return write(self, name, pieces, check)

    monkeypatch.setattr(LocalTarget, "write", spy)
    return seen


@linux_only
def test_io_threads_write_at_io_nice(tmp_path, make_tensors, make_request, monkeypatch):
    seen = _writer_niceness(monkeypatch)
    base = _nice()
    persist(make_request(str(tmp_path / "c"), make_tensors(), io_nice=4))
    assert seen and set(seen) == {min(19, base + 4)}
    assert _nice() == base  # the caller (here the training thread) keeps its priority


@linux_only
@pytest.mark.parametrize("mode", ["sync", "lazy", "gockpt_o"])
def test_engine_with_io_nice_is_exact_and_leaves_training_thread(tmp_path, monkeypatch, mode):
    seen = _writer_niceness(monkeypatch)
    base = _nice()
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, io_nice=5, min_overlap_steps=2,
                                          max_overlap_steps=2, max_shard_bytes=2048))
    live: dict[int, dict] = {}
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it in (2, 7):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 11, on_step_end=on_step_end)
    eng.close()
    assert _nice() == base
    assert seen and set(seen) == {min(19, base + 5)}
    for h in handles:
        state = gockpt.load_checkpoint(h.result().path)
        v = state.captured_step
        assert_state_equal(state.model_state_dict, live[v]["model"], f"{mode}:model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"{mode}:optim@{v}")


def test_trace_is_off_by_default_and_records_phases_when_on(tmp_path, make_tensors, make_request):
    assert not _trace.active()
    persist(make_request(str(tmp_path / "off"), make_tensors()))
    assert _trace.stop() == []

    _trace.start()
    try:
        res = persist(make_request(str(tmp_path / "on"), make_tensors()))
    finally:
        events = _trace.stop()
    assert not _trace.active()
    phases = {e.phase for e in events}
    assert {"write", "checksum", "fsync", "manifest", "publish", "latest"} <= phases
    assert sum(e.nbytes for e in events if e.phase == "write") == sum(
        f["bytes"] for f in res.files.values())
    assert all(e.end >= e.start and e.cpu_end >= e.cpu_start for e in events)
    assert {e.thread for e in events if e.phase == "write"} <= {
        f"gockpt-io_{i}" for i in range(4)}


def test_engine_trace_has_copy_and_replay(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3,
                                          max_overlap_steps=3, max_shard_bytes=2048))
    _trace.start()
    try:
        def on_step_end(it: int) -> None:
            eng.step_end()
            if it == 2:
                eng.save(str(tmp_path / "ckpt"))

        train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
        eng.close()
    finally:
        events = _trace.stop()
    by_thread = {(e.thread, e.phase) for e in events}
    assert ("gockpt-copy", "copy") in by_thread
    assert ("gockpt-replay", "replay") in by_thread
    assert any(t.startswith("gockpt-persist") and p == "serialize" for t, p in by_thread)


def test_timeline_helpers():
    assert bench_timeline._covered([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)], 0.5, 3.5) == 2.0
    times = [1.0, 2.0, 1.0, 1.0, 3.0, 1.0]
    starts = [0.0, 1.0, 3.0, 4.0, 5.0, 8.0]
    split = bench_timeline.step_split(times, starts, [0, 4], [1.0, 8.5], [3.5, 9.0],
                                      [1.0, 1.0, 1.0, 1.0])
    assert split["during_n"] == 2 and split["during_median_s"] == 1.5  # steps 1 and 2
    assert split["during_vs_free"] == 1.5 and split["request_step_median_s"] == 2.0
    assert "during_less_own_vs_free" not in split
    # The checkpointer's own waits come off the steps they fell in: three steps in flight
    # (1, 2, 3), step 1 waited 0.8 s, step 3 0.6 s; a median, not a mean, of what is left.
    waits = [0.1, 0.8, 0.0, 0.6, 0.2, 0.0]
    less = bench_timeline.step_split(times, starts, [0, 4], [1.0, 8.5], [4.5, 9.0],
                                     [1.0, 1.0, 1.0, 1.0], waits)
    assert less["during_n"] == 3
    assert less["during_less_own_median_s"] == pytest.approx(1.0)  # of 1.2, 1.0 and 0.4
    assert less["during_less_own_vs_free"] == pytest.approx(1.0)
    assert less["own_wait_during_mean_s"] == pytest.approx(1.4 / 3)
    ev = _trace.Event("gockpt-io_0", "write", 1.0, 1.5, 0.0, 0.4, 10, 1)
    rows = bench_timeline.timeline([ev, ev._replace(start=2.0, end=2.5, cpu_start=0.5,
                                                    cpu_end=0.6)], 0.5, 9.0)
    assert rows[0]["count"] == 2 and rows[0]["bytes"] == 20 and rows[0]["first_s"] == 0.5
    assert rows[0]["between_cpu_s"] == pytest.approx(0.1)
    assert bench_timeline.lone_checkpoint([0.0, 1.0, 2.0, 3.0], [1.5, 1.9, 2.5, 3.5]) == 2
    assert bench_timeline.lone_checkpoint([0.0, 1.0], [1.5, 2.5]) == 1  # none alone: the middle
    text = bench_timeline.format_report("x", split, rows, {"write": {"steps": 1, "ratio": 1.1}}, 0)
    assert "gockpt-io_0" in text and "write 1.10x (1)" in text


def test_copy_of_one_block_is_one_phase_per_chunk():
    copier = gockpt.transfer.CpuCopier(chunk_bytes=4096)
    src = torch.arange(5000, dtype=torch.float32)
    dst = torch.empty_like(src)
    _trace.start()
    try:
        copier.copy([(src, dst)], gockpt.transfer.PRIORITY_STATE).wait()
    finally:
        events = _trace.stop()
        copier.close()
    assert torch.equal(src, dst)
    copies = [e for e in events if e.phase == "copy"]
    assert len(copies) == 5 and sum(e.nbytes for e in copies) == 20000
