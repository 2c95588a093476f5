"""Checkpoints requested faster than storage persists them: the wait for the host slot, predicted
against measured, per save.

With one host slot (the default), a request that comes while the save before is still being
written out borrows its slot and waits (``slot_wait``) for the bytes it overwrites. The engine
predicts that wait at the request (``CheckpointMetrics.predicted_slot_wait_s``, part of
``predicted_stall_s``). This script trains a model of 8 linear layers (1024 x 1024, AdamW: about
100 MB of state) on one thread, writes its checkpoints through ``examples/throttled_fs.py`` (an
emulated link of ``--rate`` bytes/s, not a measurement of a device), and prints, per save, the
measured and predicted slot wait and stall, then a summary: the stall over the predicted stall
per save, and how many saves are within 1.2x.

Usage::

    python examples/bench_storage_wait.py --mode lazy --gaps 5
    python examples/bench_storage_wait.py --mode gockpt_o --k 3 --gaps 3 9 5 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throttled_fs  # noqa: E402  (registers the "throttled" fsspec protocol)

import gockpt  # noqa: E402


def run(mode: str, k: int, rate: float, gaps: list[int], checkpoints: int, skip: int,
        width: int = 1024) -> list:
    """Metrics of ``checkpoints`` saves, requested after ``gaps`` steps in turn, the first
    ``skip`` left out (no persist has ended before them: nothing to predict from), for 8
    linear layers of ``width`` x ``width``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, width)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    cfg = gockpt.GoCkptConfig(mode=mode, min_overlap_steps=k, max_overlap_steps=k,
                              storage_options=throttled_fs.storage_options(rate))
    handles = []
    with tempfile.TemporaryDirectory() as root:
        eng = gockpt.Engine(model, opt, cfg)
        try:
            for r in range(checkpoints):
                for i in range(gaps[r % len(gaps)]):
                    step()
                    eng.step_end()
                    if i == 0:
                        handles.append(eng.save(f"{root}/ckpt-{r}"))
            eng.wait()
        finally:
            eng.close()
        return [h.result() for h in handles[skip:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="lazy", choices=["lazy", "gockpt", "gockpt_o", "auto"])
    p.add_argument("--k", type=int, default=1, help="copy windows per save (min = max)")
    p.add_argument("--rate", type=float, default=60e6, help="emulated storage link, bytes/s")
    p.add_argument("--gaps", type=int, nargs="+", default=[5], help="steps between requests, in turn")
    p.add_argument("--checkpoints", type=int, default=12)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--width", type=int, default=1024, help="width of the 8 linear layers")
    args = p.parse_args()
    ms = run(args.mode, args.k, args.rate, args.gaps, args.checkpoints, args.skip, args.width)
    print(f"# mode {args.mode}, K {args.k}, emulated link {args.rate / 1e6:.1f} MB/s, "
          f"gaps {args.gaps}, width {args.width}; first {args.skip} saves left out")
    print("| save | K | borrowed | slot wait (ms) | predicted (ms) | stall (ms) | predicted stall (ms) |")
    print("|---:|---:|:---:|---:|---:|---:|---:|")
    for i, m in enumerate(ms, start=args.skip):
        print(f"| {i} | {m.num_overlap_steps} | {'yes' if m.slot_borrowed else 'no'} | "
              f"{m.stall_by_phase_s.get('slot_wait', 0.0) * 1e3:.1f} | "
              f"{getattr(m, 'predicted_slot_wait_s', 0.0) * 1e3:.1f} | {m.stall_s * 1e3:.1f} | "
              f"{m.predicted_stall_s * 1e3:.1f} |")
    ratios = sorted(m.stall_s / m.predicted_stall_s for m in ms if m.predicted_stall_s > 0)
    if ratios:
        within = sum(1 / 1.2 <= r <= 1.2 for r in ratios)
        # A save that waits a few milliseconds has a ratio far from 1 for any small miss.
        miss = statistics.median(abs(m.stall_s - m.predicted_stall_s) for m in ms)
        print(f"stall / predicted stall per save: median {statistics.median(ratios):.2f}, "
              f"range {ratios[0]:.2f}-{ratios[-1]:.2f}, within 1.2x: {within}/{len(ms)}; "
              f"median |stall - predicted| {miss * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
