"""What one checkpoint request costs the training thread, by the number of parameters.

Two measurements per parameter count ``n``:

- ``plan``: :func:`gockpt.plan.make_plan` for ``gockpt_o`` with K up to 7 (the per-window block
  split and its lower bound), on ``n`` units of mixed sizes, median of ``--repeats`` calls;
- ``request`` and ``capture``: the per-save fixed cost that :class:`gockpt.Engine` reports
  (``CheckpointMetrics.stall_by_phase_s``), for a model of ``n`` small linear layers with AdamW,
  mode ``gockpt_o``, median over ``--saves`` saves after a warm-up save (each save waits for the
  one before, so the host slot is reused).

Usage::

    python examples/bench_planner.py --units 20 187 1000
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from torch import nn

from gockpt import Engine, GoCkptConfig
from gockpt.plan import Costs, make_plan


def plan_ms(n: int, repeats: int) -> float:
    """Median milliseconds of one ``make_plan("gockpt_o", ...)`` over ``n`` units."""
    rng = random.Random(0)
    units = [rng.choice([4096 * 12, 2 * 1024 * 1024 * 3, 8 * 1024 * 3]) for _ in range(n)]
    grads = [u // 3 for u in units]  # fp32 weights with AdamW: the gradient is a third
    costs = Costs(copy_bytes_per_s=0.18e9, window_s=0.15, window_overhead_s=0.002)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        make_plan("gockpt_o", units, grads, costs, max_overlap_steps=7, replayable=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def request_capture_ms(n: int, saves: int) -> tuple[float, float]:
    """Median milliseconds of the ``request`` and ``capture`` stall phases of an engine's saves."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(n)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    request, capture = [], []
    with tempfile.TemporaryDirectory() as root, Engine(model, opt, GoCkptConfig(mode="gockpt_o")) as eng:
        for i in range(saves + 1):
            handle = eng.save(f"{root}/c{i}")
            for _ in range(8):  # K <= 7 windows: the save is captured within 8 steps
                step()
                eng.step_end()
            by = handle.result().stall_by_phase_s
            if i:  # the first save allocates the slot and enumerates the layout
                request.append(by.get("request", 0.0))
                capture.append(by.get("capture", 0.0))
            eng.remove(f"{root}/c{i}")
    return statistics.median(request) * 1e3, statistics.median(capture) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, nargs="+", default=[20, 60, 187, 500, 1000])
    parser.add_argument("--repeats", type=int, default=60, help="make_plan calls per count")
    parser.add_argument("--saves", type=int, default=9, help="measured engine saves per count")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| parameters | plan (ms) | request (ms) | capture (ms) |")
    print("|---:|---:|---:|---:|")
    for n in args.units:
        req, cap = request_capture_ms(n, args.saves)
        print(f"| {n} | {plan_ms(n, args.repeats):.2f} | {req:.2f} | {cap:.2f} |", flush=True)


if __name__ == "__main__":
    main()
