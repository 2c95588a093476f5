"""The CPU replay's gradient-buffer waits: predicted against measured, with an emulated slow replay.

On a GPU whose steps take milliseconds, the CPU replay of each update's gradients (GoCkpt §4.3)
can take several steps. A capture of gradients then waits for the host buffer that the replay of
the capture two updates before still holds (two buffers, used in turn): the ``grad_buffer``
stall. The planner predicts that wait from the replay rate it measures
(:func:`gockpt.plan.replay_wait_s`) and charges it when it chooses K.

This machine has no GPU, so both sides are emulated, and the output says so: the copy worker is
throttled so that a full copy of the state spans ``--copy-steps`` steps
(``GoCkptConfig.host_link_bytes_per_s``), and the replay thread is paced so that replaying the
whole state once takes ``--replay-steps`` steps (``GoCkptConfig.replay_bytes_per_s``). One
process trains a stack of ``Linear`` layers (fp32 weights, AdamW) and runs, one after another,
an engine per row:

- ``lazy``: one window, nothing replayed;
- ``gockpt_o K>=7``: seven windows or more (``min_overlap_steps=7``), whatever they cost;
- ``auto``: the planner's choice.

Each row takes a warm-up checkpoint (the replay rate and the step windows are measured there),
then ``--checkpoints`` measured ones ``--interval`` steps apart. Printed per row, means over
the measured checkpoints: K, the predicted stall and of it the predicted replay wait, the
measured stall and of it the measured ``grad_buffer`` wait. Usage::

    python examples/bench_replay_wait.py --layers 6 --copy-steps 2 --replay-steps 30
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import gockpt

WIDTH = 2048


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6, help="Linear(2048, 2048) layers")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--copy-steps", type=float, default=2.0,
                   help="emulated link: a full copy of the state spans this many steps")
    p.add_argument("--replay-steps", type=float, default=30.0,
                   help="emulated replay: replaying the whole state once takes this many steps")
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--interval", type=int, default=16, help="steps between checkpoints")
    p.add_argument("--rows", nargs="+", default=["lazy", "gockpt_o", "auto"])
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(args.batch, WIDTH)
    state_bytes = 3 * sum(q.numel() * q.element_size() for q in model.parameters())

    def step() -> float:
        t = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    clean = statistics.median(step() for _ in range(6))
    link = state_bytes / (args.copy_steps * clean)
    replay = state_bytes / (args.replay_steps * clean)
    print(f"{state_bytes / 1e6:.0f} MB of state (fp32 weights + AdamW), clean step {clean:.3f} s; "
          f"EMULATED: host link {link / 1e9:.2f} GB/s (a full copy spans {args.copy_steps:g} "
          f"steps), CPU replay {replay / 1e9:.2f} GB/s of state (the whole state in "
          f"{args.replay_steps:g} steps); {args.checkpoints} checkpoints every {args.interval} "
          f"steps per row, means.")
    # "window model alone": the prediction less its replay wait, what the planner predicted
    # before it priced the replay.
    print("| row | K | predicted stall (s) | of which replay wait (s) | window model alone (s) | "
          "measured stall (s) | of which grad_buffer (s) | measured / predicted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in args.rows:
        mode = "gockpt_o" if row == "gockpt_o" else row
        config = gockpt.GoCkptConfig(mode=mode, host_link_bytes_per_s=link, replay_bytes_per_s=replay,
                                     min_overlap_steps=7 if row == "gockpt_o" else 1)
        metrics = []
        with tempfile.TemporaryDirectory() as root, gockpt.Engine(model, opt, config) as engine:
            engine.save(f"{root}/warmup", mode="gockpt_o")  # measures windows, link and replay
            for _ in range(args.interval):
                step()
                engine.step_end()
            engine.wait()
            for i in range(args.checkpoints):
                handle = engine.save(f"{root}/c{i}")
                for _ in range(args.interval):
                    step()
                    engine.step_end()
                metrics.append(handle.result())
                engine.remove(f"{root}/c{i}")
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        ks = sorted({m.num_overlap_steps for m in metrics})
        predicted = mean([m.predicted_stall_s for m in metrics])
        measured = mean([m.stall_s for m in metrics])
        name = "gockpt_o K>=7" if row == "gockpt_o" else row
        replay_wait = mean([m.predicted_replay_wait_s for m in metrics])
        print(f"| {name} | {', '.join(map(str, ks))} | {predicted:.3f} | {replay_wait:.3f} | "
              f"{predicted - replay_wait:.3f} | {measured:.3f} | "
              f"{mean([m.stall_by_phase_s.get('grad_buffer', 0.0) for m in metrics]):.3f} | "
              f"{measured / predicted if predicted > 0 else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
