"""examples/bench_scale.py runs end to end at a tiny size and prints one row per scheme."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_scale.py"


def test_bench_scale_prints_a_row_per_scheme(tmp_path):
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--sizes-gb", "0.01", "--modes", "lazy", "--checkpoints", "2",
         "--interval", "2", "--warmup", "1", "--dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 0.")]
    assert [r[1].strip() for r in rows] == ["none", "torch.save", "gockpt lazy"]
    lazy = rows[2]
    assert float(lazy[6]) > 0  # time to durable of the engine's checkpoints
    assert list(tmp_path.iterdir()) == []  # each run removes its checkpoints


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
