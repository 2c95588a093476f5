"""The example benchmarks (bench_scale.py, bench_storage_wait.py, bench_interference.py,
bench_floor.py, bench_planner.py, benchmark.py) run end to end at a tiny size and report every scheme they were asked for."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_scale.py"


def test_bench_scale_prints_a_row_per_scheme(tmp_path):
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--sizes-gb", "0.01", "--modes", "lazy", "--checkpoints", "2",
         "--interval", "2", "--warmup", "1", "--dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=300).stdout
    first, engine = out.split("\n\n", 1)  # the rows, then the engine's plans and stalls
    rows = [line.split("|")[1:-1] for line in first.splitlines() if line.startswith("| 0.")]
    assert [r[1].strip() for r in rows] == ["none", "torch.save", "gockpt lazy"]
    lazy = rows[2]
    assert float(lazy[6]) > 0  # time to durable of the engine's checkpoints
    plans = [line.split("|")[1:-1] for line in engine.splitlines() if line.startswith("| 0.")]
    assert [r[1].strip() for r in plans] == ["gockpt lazy"]
    k, predicted, slot_wait, replay_wait, bound, measured = (float(x) for x in plans[0][2:8])
    assert k == 1 and 0 <= bound <= predicted and 0 <= slot_wait <= predicted and measured >= 0
    assert replay_wait == 0.0  # lazy replays nothing
    assert int(plans[0][10]) > 0  # clean steps to compare against
    assert float(plans[0][11]) >= 1.0  # host peak: at least the one snapshot, in checkpoint sizes
    assert list(tmp_path.iterdir()) == []  # each run removes its checkpoints


def test_bench_storage_wait_prints_each_save_with_its_predicted_wait():
    # A store paced at 8 MB/s and a request every other step: every save after the first
    # borrows the slot the one before is still writing out, and a wait is predicted for it.
    script = _SCRIPT.parent / "bench_storage_wait.py"
    out = subprocess.run(
        [sys.executable, str(script), "--width", "128", "--rate", "8e6", "--gaps", "2",
         "--checkpoints", "5"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [2, 3, 4]  # the first two left out
    for _, k, borrowed, waited, predicted, stall, predicted_stall in rows:
        assert borrowed.strip() == "yes" and float(waited) > 0 and float(predicted) > 0
        assert float(predicted_stall) >= float(predicted)
    assert re.search(r"within 1\.2x: \d/3; median \|stall - predicted\| \d+ ms", out)


def test_bench_interference_measures_every_condition_and_leaves_nothing(tmp_path):
    script = _SCRIPT.parent / "bench_interference.py"
    out = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--steps", "6", "--preset", "tiny",
         "--modes", "lazy", "--dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| condition")}
    assert list(rows) == ["none", "process writer", "thread writer", "gockpt lazy"]
    assert [float(x) for x in rows["none"]] == [1.0, 1.0, 1.0]
    assert all(float(x) > 0 for r in rows.values() for x in r)
    assert list(tmp_path.iterdir()) == []  # the writes and checkpoints are removed


def test_bench_interference_paced_writer_reports_its_cost_per_gb(tmp_path):
    script = _SCRIPT.parent / "bench_interference.py"
    out = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--steps", "6", "--preset", "tiny",
         "--paced", "0.5", "--modes", "--dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=300).stdout
    lines = out.splitlines()
    split = next(i for i, ln in enumerate(lines) if ln.startswith("| writer"))
    steps = [ln.split("|")[1].strip() for ln in lines[:split]
             if ln.startswith("| ") and not ln.startswith("| condition")]
    assert steps == ["none", "process writer", "thread writer", "thread writer at 0.5"]
    rows = {ln.split("|")[1].strip(): [x.strip() for x in ln.split("|")[2:6]]
            for ln in lines[split + 2:] if ln.startswith("| ")}
    assert list(rows) == ["thread writer", "thread writer at 0.5"]
    # On a slow disk the unpaced writer may finish no write in 6 tiny steps: then no paced run.
    for cells in rows.values():
        assert all(c == "-" for c in cells) or all(math.isfinite(float(c)) for c in cells)
    assert list(tmp_path.iterdir()) == []


def test_pacer_holds_a_writer_to_its_rate_across_files(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_SCRIPT.parent))
    from bench_interference import Pacer, aligned_buffer, write_file

    view = memoryview(aligned_buffer(4 << 20))
    written = [0]
    start = time.perf_counter()
    pacer = Pacer(80e6)
    for name in ("a", "b"):  # one rate over both files: 8 MiB at 80 MB/s take >= 0.105 s
        write_file(str(tmp_path / name), view, pacer=pacer, written=written)
    assert written[0] == 8 << 20
    assert time.perf_counter() - start >= (8 << 20) / 80e6
    with pytest.raises(ValueError):
        Pacer(0.0)


def test_bench_floor_reports_the_floor_beside_gockpt_and_leaves_nothing(tmp_path):
    script = _SCRIPT.parent / "bench_floor.py"
    out = subprocess.run(
        [sys.executable, str(script), "--rounds", "2", "--steps", "4", "--interval", "2",
         "--preset", "tiny", "--mode", "lazy", "--dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=300).stdout
    tables = [[ln.split("|")[1:-1] for ln in block.splitlines()
               if ln.startswith("| ") and not ln.startswith("| condition")]
              for block in out.split("\n\n") if "| condition" in block]
    assert len(tables) == 2  # the extra wall time, then its split on the training thread
    rows = {cells[0].strip(): cells[1:] for cells in tables[0]}
    split = {cells[0].strip(): cells[1:] for cells in tables[1]}
    assert list(rows) == list(split) == ["none (again) (the floor)", "disk only", "gockpt lazy"]
    assert rows["none (again) (the floor)"][2].strip() == rows["disk only"][2].strip() == "-"
    assert float(rows["gockpt lazy"][2]) > 0  # the engine's own stall: its requests at least

    def mean_interval(cell: str) -> tuple[float, float, float]:
        mean, rest = cell.split("[")
        lo, hi = (float(x) for x in rest.rstrip("] ").split(","))
        assert all(math.isfinite(x) for x in (float(mean), lo, hi)) and lo <= hi
        return float(mean), lo, hi

    for name, (median, interval, _) in rows.items():
        assert math.isfinite(float(median))
        wall = mean_interval(interval)[0]
        cpu, off, tail, queued, blocked = (mean_interval(c)[0] for c in split[name])
        assert cpu + off == pytest.approx(wall, abs=1e-3)  # the split adds up to the whole
        assert tail + queued + blocked == pytest.approx(off, abs=1e-3)  # and so does its part
    # disk only writes what a save of the state does (weights and optimizer state, not the
    # weights alone: taken after the optimizer's first step)
    counts = next(ln for ln in out.splitlines() if ln.startswith("bytes per checkpoint"))
    disk = int(re.search(r"disk_only=(\d+)", counts).group(1))
    saved = int(re.search(r"engine=(\d+)", counts).group(1))
    assert abs(disk - saved) <= 0.05 * saved + (256 << 10)
    assert list(tmp_path.iterdir()) == []


def test_run_queue_reads_the_schedulers_wait_and_says_when_it_cannot(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_SCRIPT.parent))
    from bench_floor import run_queue_s

    stat = tmp_path / "schedstat"
    stat.write_text("123456789 4500000000 17\n")  # CPU ns, run-queue ns, timeslices
    assert run_queue_s(str(stat)) == 4.5
    assert run_queue_s(str(tmp_path / "missing")) is None
    stat.write_text("garbage\n")
    assert run_queue_s(str(stat)) is None
    if Path("/proc/thread-self/schedstat").exists():  # this thread's own, on Linux
        first = run_queue_s()
        assert first is not None and first >= 0 and run_queue_s() >= first


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_values(monkeypatch):
    monkeypatch.syspath_prepend(str(_SCRIPT.parent))
    from bench_floor import bootstrap_interval

    few = [1.0, 3.0, 2.0, 6.0]
    lo, hi = bootstrap_interval(few)
    assert lo <= sum(few) / len(few) <= hi and min(few) <= lo < hi <= max(few)
    lo2, hi2 = bootstrap_interval(few * 25)
    assert hi2 - lo2 < hi - lo


def test_benchmark_quick_run_reports_the_disk_floor_beside_gockpt(tmp_path):
    # The whole pipeline at a tiny size: per-scheme processes, the disk-only reference (another
    # process writing as many bytes), GoCkpt, the report and its targets.
    script = _SCRIPT.parent / "benchmark.py"
    subprocess.run([sys.executable, str(script), "--quick", "--schemes", "none,disk-only,gockpt-lazy",
                    "--no-repeat", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    rows = {r["scheme"]: r for r in report["results"] if not r["emulated"]}
    assert set(rows) == {"none", "disk-only", "gockpt-lazy"}
    disk = rows["disk-only"]
    # Every checkpoint's write was reported complete, fsynced, and read back at the restore.
    assert len(disk["durable_s"]) == len(disk["ckpt_steps"]) > 0 and disk["fsync"] is True
    assert disk["bytes_on_disk"] >= disk["state_bytes"] and disk["restore_s"] > 0
    assert any(line.startswith("disk floor") for line in report["targets"])
    assert "reference: the same bytes written by another process" in (tmp_path / "benchmark.md").read_text()


def test_bench_planner_prints_plan_request_and_capture_per_parameter_count():
    script = _SCRIPT.parent / "bench_planner.py"
    out = subprocess.run(
        [sys.executable, str(script), "--units", "3", "12", "--repeats", "3", "--saves", "2"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    assert [int(r[0]) for r in rows] == [3, 12]
    assert all(float(x) > 0 for r in rows for x in r[1:])  # plan, request, capture (ms)


@pytest.mark.parametrize("flag, value, arms, forecasts, label", [
    # The emulated-link auto row at the median and at another quantile ...
    ("--window-quantile", "0.25", [(0.5, None), (0.25, None)],
     ["quantile 0.25 of the latest windows", "quantile 0.5 of the latest windows"],
     "[window_quantile 0.25] (round 2)"),
    # ... or at the default memory and a longer one, one after the other in each round.
    ("--window-memory", "40", [(None, None), (None, 40)],
     ["quantile 0.25 of the latest 15 windows", "quantile 0.25 of the latest 40 windows"],
     "[window_memory 40] (round 2)"),
])
def test_benchmark_compares_two_window_forecasts_in_alternation(tmp_path, flag, value, arms,
                                                                forecasts, label):
    # Each row's config recorded and each forecast summed up.
    script = _SCRIPT.parent / "benchmark.py"
    subprocess.run([sys.executable, str(script), "--quick", "--emulated-only", "--schemes",
                    "none,gockpt-auto", "--no-repeat", "--no-lightning", flag, value,
                    "--forecast-rounds", "2", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    rounds = [(r.get("forecast_round"), r.get("window_quantile"), r.get("window_memory"))
              for r in report["results"]
              if r["scheme"] == "gockpt-auto" and r.get("forecast_round") is not None]
    assert rounds == [(k, q, m) for k in (0, 1) for q, m in arms]
    lines = [ln for ln in report["targets"] if ln.startswith("window forecast")]
    assert [ln.split(":")[1].strip() for ln in lines] == forecasts
    assert all("median of 2 rounds" in ln and "of which waits at window ends" in ln for ln in lines)
    assert label in (tmp_path / "benchmark.md").read_text()


@pytest.mark.parametrize("args, error", [
    (["--window-quantile", "2"], "--window-quantile must be in [0, 1]"),
    (["--window-memory", "0"], "--window-memory must be at least 1"),
    (["--window-memory", "15"], "is the default: nothing to compare"),
])
def test_benchmark_refuses_a_window_forecast_it_cannot_compare(tmp_path, args, error):
    script = _SCRIPT.parent / "benchmark.py"
    bad = subprocess.run([sys.executable, str(script), *args, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and error in bad.stderr


def test_bench_replay_wait_predicts_the_waits_of_an_emulated_slow_replay():
    # Replaying the whole state takes 20 steps (emulated, from the step time measured at the
    # start): a plan of six windows waits for gradient buffers the replay still holds, and its
    # prediction counts that wait. (At 8 steps a machine whose steps slowed after that
    # measurement, a second test worker starting, let the replay keep up: no wait to count.)
    script = _SCRIPT.parent / "bench_replay_wait.py"
    out = subprocess.run(
        [sys.executable, str(script), "--layers", "3", "--batch", "4", "--checkpoints", "1",
         "--interval", "10", "--replay-steps", "20", "--rows", "gockpt_o", "auto"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    assert "EMULATED" in out
    rows = {r[0].strip(): r[1:] for r in (line.split("|")[1:-1] for line in out.splitlines()
                                          if line.startswith("| gockpt_o") or line.startswith("| auto"))}
    k, predicted, replay_wait, alone, measured, grad_buffer, _ = rows["gockpt_o K>=7"]
    # Six units (three layers' weights and biases): at most six windows, five captures.
    assert int(k) == 6 and float(replay_wait) > 0 and float(grad_buffer) > 0
    assert float(predicted) == pytest.approx(float(replay_wait) + float(alone), abs=2e-3)
    # auto prices those waits: it never plans a capture that waits for a buffer.
    assert int(rows["auto"][0].split(",")[-1]) <= 3 and float(rows["auto"][2]) == 0.0


def test_bench_lightning_splits_fit_and_reports_the_last_checkpoints_floor(tmp_path, monkeypatch):
    # Lightning's defaults section: fit split into set-up, loop and the wait after the last
    # batch, in-process at the tiny size (one checkpoint per epoch of 2 steps).
    import argparse
    import multiprocessing

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    import bench_lightning
    args = argparse.Namespace(preset="tiny", data=None, batch_size=None, steps=4, interval=2)
    results = []
    for i, variant in enumerate(("none", "gockpt", "none")):
        path = tmp_path / f"{i}.json"
        bench_lightning.run_variant(args, variant, str(tmp_path / f"run{i}"), str(path))
        results.append(json.loads(path.read_text()))
    for r in results:
        assert r["global_step"] == 4
        assert r["before_s"] > 0 and r["loop_s"] > 0 and r["after_s"] >= 0
        assert r["steps_s"] <= r["loop_s"]
        assert math.isclose(r["before_s"] + r["loop_s"] + r["after_s"], r["wall_s"], rel_tol=0.05)
    assert [r["checkpoints"] for r in results] == [0, 2, 0]
    text = bench_lightning.section(results, 2, write_gbps=1.0)
    row = next(line for line in text.splitlines() if line.startswith("| GoCkptIO()"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert len(cells) == 10
    loop_extra = (results[1]["loop_s"] - (results[0]["loop_s"] + results[2]["loop_s"]) / 2) / 2
    assert float(cells[6]) == pytest.approx(loop_extra, abs=0.0011)
    floor = results[0]["state_bytes"] / 1e9
    assert f"{floor:.2f} s for" in text and "GoCkptIO() " in text.split("After the last batch")[1]
    assert multiprocessing.parent_process() is None  # ran here, not in a fork
