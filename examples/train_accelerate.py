"""Train a small byte-level Llama on real text with Accelerate, checkpointing through GoCkpt.

The same workload as ``train_lightning.py`` (``examples/workload.py``: Python's documentation as
bytes, a Llama built from a config). GoCkpt costs the script two lines, marked ``# GoCkpt``;
everything else is a plain Accelerate loop with ``save_state``/``load_state``.

Run::

    python examples/train_accelerate.py --project-dir runs/accelerate --steps 200 --save-every 25
    python examples/train_accelerate.py --project-dir runs/accelerate --steps 300 --resume
    GOCKPT_MODE=gockpt GOCKPT_MIN_OVERLAP_STEPS=3 accelerate launch --multi_gpu --num_processes 2 \\
        examples/train_accelerate.py --cpu --project-dir runs/ddp --steps 100

(``--multi_gpu`` is how ``accelerate launch`` starts several processes; with ``--cpu`` they
train on the CPU over gloo. ``GOCKPT_MIN_OVERLAP_STEPS=3`` makes every checkpoint span three
updates; without it ``gockpt`` picks K from measured timings, often 1 on a CPU.) Options of GoCkpt come from ``GOCKPT_*`` variables or a file named
by ``GOCKPT_CONFIG_FILE``; ``GOCKPT_ENABLED=0`` runs Accelerate's own blocking ``save_state``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as common  # noqa: E402

from accelerate_gockpt import attach  # noqa: E402  # GoCkpt


class Progress:
    """Batches trained so far; registered for checkpointing, so resuming knows where it is."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = int(state["batches"])


@dataclass
class Summary:
    """What :func:`run` did.

    Attributes:
        batches: batches trained at the end (including those before a resume).
        resumed_from: the checkpoint loaded, or None.
        losses: (batch, loss) at every logged batch.
        save_call_s: wall seconds of each ``save_state`` call on the training thread.
        checkpoints: published checkpoint folders (main process).
        model_state: the unwrapped model's final state_dict (CPU tensors).
    """

    batches: int = 0
    resumed_from: str | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    save_call_s: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    model_state: dict[str, torch.Tensor] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--project-dir", required=True, help="checkpoints go to <dir>/checkpoints")
    p.add_argument("--preset", default="small", choices=sorted(common.PRESETS))
    p.add_argument("--data", default=None, help="text file or folder (default: Python's docs)")
    p.add_argument("--steps", type=int, default=200, help="batches to train in total")
    p.add_argument("--save-every", type=int, default=25, help="batches between save_state calls")
    p.add_argument("--total-limit", type=int, default=3, help="checkpoints kept")
    p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20, help="batches of linear LR warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="load the newest checkpoint first")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> Summary:
    """Train as ``args`` say; returns a :class:`Summary`."""
    accelerator = Accelerator(
        cpu=args.cpu,
        gradient_accumulation_steps=args.accumulation,
        project_config=ProjectConfiguration(project_dir=args.project_dir,
                                            automatic_checkpoint_naming=True,
                                            total_limit=args.total_limit),
    )
    preset = common.PRESETS[args.preset]
    train_set, _ = common.text_datasets(args.data, seq_len=preset.seq_len)
    model, loss_fn = common.build_model(args.preset, seed=args.seed)
    optimizer = common.make_optimizer(model, lr=args.lr)
    # A prepared scheduler steps once per process at each update (Accelerate scales it with the
    # effective batch), so its horizon counts updates x processes.
    scale = accelerator.num_processes
    updates = max(1, args.steps // args.accumulation) * scale
    warmup = args.warmup * scale

    def lr_factor(update: int) -> float:  # linear warm-up, then cosine decay
        if update < warmup:
            return (update + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (update - warmup) / max(1, updates - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    loader = common.make_dataloader(train_set, preset.batch_size, seed=args.seed)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    checkpointer = attach(accelerator)  # GoCkpt: save_state/load_state now go through it

    summary = Summary()
    checkpoints = os.path.join(args.project_dir, "checkpoints")
    if args.resume and os.path.isdir(checkpoints) and os.listdir(checkpoints):
        accelerator.load_state()
        summary.resumed_from = f"checkpoint_{accelerator.save_iteration - 1}"
        accelerator.print(f"resumed from {summary.resumed_from} at batch {progress.batches}")

    model.train()
    while progress.batches < args.steps:
        skip = progress.batches % len(loader)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.batches += 1
            if progress.batches % args.log_every == 0:
                summary.losses.append((progress.batches, loss.item()))
                accelerator.print(f"batch {progress.batches:5d}  loss {loss.item():.4f}  "
                                  f"lr {scheduler.get_last_lr()[0]:.2e}")
            if progress.batches % args.save_every == 0:
                t0 = time.perf_counter()
                accelerator.save_state()
                summary.save_call_s.append(time.perf_counter() - t0)
            if progress.batches >= args.steps:
                break

    accelerator.end_training()  # finishes GoCkpt's in-flight checkpoints, then Accelerate's own
    summary.batches = progress.batches
    summary.model_state = {k: v.detach().cpu().clone()
                           for k, v in accelerator.unwrap_model(model).state_dict().items()}
    if checkpointer is not None and accelerator.is_main_process:
        summary.checkpoints = [m.path for m in checkpointer.metrics]
        for m in checkpointer.metrics:
            accelerator.print(f"{os.path.basename(m.path)}: mode {m.mode}, K={m.num_overlap_steps}, "
                              f"captured update {m.captured_step}, stall {m.stall_s * 1e3:.1f} ms, "
                              f"durable after {m.time_to_durable_s:.2f} s")
    if summary.save_call_s:
        accelerator.print(f"save_state returned in {1e3 * sum(summary.save_call_s) / len(summary.save_call_s):.1f} "
                          f"ms on average ({len(summary.save_call_s)} calls)")
    return summary


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
