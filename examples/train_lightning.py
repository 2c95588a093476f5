"""Train a small byte-level Llama on real text with Lightning, checkpointing through GoCkpt.

The workload is ``examples/workload.py``'s: Python's own documentation (``pydoc_data.topics``, or
``--data``) as bytes, and a ``LlamaForCausalLM`` built from a config (nothing is downloaded).
GoCkpt costs the script three lines, marked ``# GoCkpt``: the import, ``GoCkptIO(...)`` and
``plugins=[io]``. Everything else is plain Lightning: a ``ModelCheckpoint`` every ``--ckpt-every`` steps and
``fit(ckpt_path=...)`` to resume. One line is printed per checkpoint once it is durable.

Run::

    python examples/train_lightning.py --demo                  # train, SIGKILL, resume, compare
    python examples/train_lightning.py --root runs/lit --max-steps 300 --ckpt-every 25
    python examples/train_lightning.py --root runs/lit --max-steps 400 --resume last

``--demo`` runs the main job end to end: it trains in a child process and kills it for real
(SIGKILL) once two checkpoints are durable and a third is being copied, resumes from
``ckpt_path="last"`` in a second child, finishes, and shows that the losses of the steps both
runs trained are identical. The demo uses the multi-step mode with K = 3 (``--mode gockpt
--overlap-steps 3``), so a checkpoint requested at step N holds step N + 2; ``auto`` picks a
single-step copy on a CPU, where a copy costs little.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as common  # noqa: E402

from lightning_gockpt import GoCkptIO  # noqa: E402  # GoCkpt


class ResumableBatches:
    """Batches of a per-epoch shuffle of ``dataset`` that resume mid-epoch.

    Sized and stateful (``state_dict``/``load_state_dict``), so Lightning saves its position in
    every checkpoint and a resumed run sees the batches the interrupted one would have seen.
    Each item is a (batch_size, seq_len + 1) int64 tensor.
    """

    def __init__(self, dataset: common.TokenWindows, batch_size: int, seed: int = 0) -> None:
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.pos = 0, 0

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def __iter__(self):
        if self.pos >= len(self):
            self.epoch, self.pos = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g)
        while self.pos < len(self):
            idx = order[self.pos * self.batch_size : (self.pos + 1) * self.batch_size]
            self.pos += 1
            yield torch.stack([self.dataset[int(i)] for i in idx])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class LlamaLM(pl.LightningModule):
    """``common.build_model``'s Llama trained with fused AdamW and a per-step warm-up/cosine LR.

    ``losses`` maps each batch's index (counted over the whole run) to its loss.
    """

    def __init__(self, preset: str = "small", data: str | None = None, seed: int = 0, lr: float = 1e-3,
                 warmup: int = 20, total_steps: int = 1000) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model, self.loss_fn = common.build_model(preset, seed=seed)
        self.losses: dict[int, float] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss_fn(self.model, batch)
        self.losses[self.trainer.fit_loop.epoch_loop.total_batch_idx] = loss.item()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = common.make_optimizer(self.model, lr=hp.lr)

        def factor(step: int) -> float:
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / max(1, hp.total_steps))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> ResumableBatches:
        preset = common.PRESETS[self.hparams.preset]
        train, _ = common.text_datasets(self.hparams.data, seq_len=preset.seq_len)
        return ResumableBatches(train, preset.batch_size, seed=self.hparams.seed)


class PrintLosses(Callback):
    """Prints ``step S loss L`` every ``every`` optimizer steps (L exactly, as Python prints it),
    and ``checkpoint of step S requested`` every ``ckpt_every`` steps."""

    def __init__(self, every: int, ckpt_every: int) -> None:
        self.every, self.ckpt_every = every, ckpt_every

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"training from step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            print(f"step {step} loss {float(outputs['loss'])!r}", flush=True)
        if step % self.ckpt_every == 0:
            print(f"checkpoint of step {step} requested", flush=True)


class PrintCheckpoints(Logger):
    """A logger that prints GoCkpt's per-checkpoint metrics, one line per durable checkpoint.

    GoCkpt logs them with the step's metrics (every ``log_every_n_steps``); a checkpoint's
    values stand until the next one is durable, so each is printed the first time it is seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[int] = set()

    @property
    def name(self) -> str:
        return "print"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "gockpt/stall_s" not in metrics or int(metrics["gockpt/requested_step"]) in self._seen:
            return
        from gockpt import MODES

        requested = int(metrics["gockpt/requested_step"])
        self._seen.add(requested)
        mode = MODES[int(metrics["gockpt/mode"])]
        print(f"checkpoint of step {requested} durable: holds step {int(metrics['gockpt/captured_step'])} "
              f"({mode}, K={int(metrics['gockpt/num_overlap_steps'])}), "
              f"stall {metrics['gockpt/stall_s'] * 1e3:.1f} ms, {metrics['gockpt/bytes'] / 1e6:.1f} MB, "
              f"durable after {metrics['gockpt/time_to_durable_s']:.2f} s "
              f"({metrics['gockpt/gbps']:.2f} GB/s)", flush=True)


def make_trainer(root: str, *, max_steps: int, ckpt_every: int, io: GoCkptIO,
                 callbacks: list[Callback] | None = None, precision: str = "32-true",
                 print_every: int = 0) -> pl.Trainer:
    """A CPU Trainer checkpointing every ``ckpt_every`` steps into ``root`` through ``io``.

    ``ModelCheckpoint`` keeps the newest checkpoint and links ``last.ckpt`` to it.
    """
    checkpoint = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=ckpt_every,
                                 save_top_k=1, save_last="link")
    extra = [PrintLosses(print_every, ckpt_every)] if print_every else []
    return pl.Trainer(
        default_root_dir=root, max_steps=max_steps, accelerator="cpu", devices=1, precision=precision,
        gradient_clip_val=1.0, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[checkpoint, *extra, *(callbacks or [])], logger=PrintCheckpoints(),
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        plugins=[io],  # GoCkpt
    )


def train(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", ".*(exists and is not empty|LeafSpec|logging interval).*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    k = {} if args.overlap_steps is None else {"min_overlap_steps": args.overlap_steps,
                                                "max_overlap_steps": args.overlap_steps}
    io = GoCkptIO(mode=args.mode, log_metrics=True, **k)  # GoCkpt
    module = LlamaLM(preset=args.preset, data=args.data, seed=args.seed, lr=args.lr,
                     total_steps=args.max_steps)
    trainer = make_trainer(args.root, max_steps=args.max_steps, ckpt_every=args.ckpt_every, io=io,
                           precision=args.precision, print_every=args.print_every)
    trainer.fit(module, ckpt_path=args.resume)
    print(f"finished at step {trainer.global_step}", flush=True)


def demo(args: argparse.Namespace) -> None:
    """Train in a child, SIGKILL it mid-run, resume from "last" in another, compare the losses."""
    if os.path.exists(args.root):
        shutil.rmtree(args.root)
    base = [sys.executable, os.path.abspath(__file__), "--root", args.root, "--preset", args.preset,
            "--max-steps", str(args.max_steps), "--ckpt-every", str(args.ckpt_every), "--mode", args.mode,
            "--print-every", "1", "--seed", str(args.seed)]
    base += ["--overlap-steps", str(args.overlap_steps)] if args.overlap_steps else []
    base += ["--data", args.data] if args.data else []
    print(f"== 1. train the {args.preset} Llama on {args.data or 'Python docs'} with GoCkpt "
          f"(mode {args.mode}), a checkpoint every {args.ckpt_every} steps into {args.root}", flush=True)
    before, killed_at = _run_child(base, kill=True)
    print(f"== 2. killed with SIGKILL after step {killed_at}, while the checkpoint requested at step "
          f"{killed_at - 1} was still in flight", flush=True)
    print("== 3. resume with ckpt_path='last' and finish", flush=True)
    after, _ = _run_child(base + ["--resume", "last"], kill=False)
    both = sorted(set(before) & set(after))
    if not both:
        raise SystemExit("the resumed run shares no step with the killed one")
    same = all(before[s] == after[s] for s in both)
    print(f"== 4. the resumed run restarted after step {both[0] - 1} and trained steps {both[0]}..{both[-1]} "
          "again, which the killed run had trained too:", flush=True)
    for s in (both[:3] + both[-2:] if len(both) > 5 else both):
        print(f"   step {s}: loss before the kill {before[s]:.6f}, after resuming {after[s]:.6f}")
    print(f"   {'identical' if same else 'DIFFERENT'} on all {len(both)} steps: the loss continues where it "
          f"stopped, down to {after[max(after)]:.4f} at step {max(after)}", flush=True)
    if not same:
        raise SystemExit(1)


def _run_child(cmd: list[str], kill: bool) -> tuple[dict[int, float], int]:
    """Run ``cmd`` and echo its output; with ``kill``, SIGKILL it one step after the third
    checkpoint request once two checkpoints are durable. Returns ({step: loss}, last step)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    losses: dict[int, float] = {}
    durable, requested, step = 0, 0, 0
    for line in proc.stdout:
        if line.startswith("step "):
            _, step_s, _, loss = line.split()
            step = int(step_s)
            losses[step] = float(loss)
            if step % 10 == 0:
                print("   " + line, end="", flush=True)
            if kill and durable >= 2 and requested >= 3:
                proc.send_signal(signal.SIGKILL)
                break
            continue
        requested += line.endswith("requested\n")
        durable += line.startswith("checkpoint of step") and "durable" in line
        if not line.endswith("requested\n"):
            print("   " + line, end="", flush=True)
    code = proc.wait()
    if kill and code != -signal.SIGKILL:
        raise SystemExit(f"the run ended ({code}) before it could be killed; raise --max-steps")
    if not kill and code != 0:
        raise SystemExit(f"training exited with {code}")
    return losses, step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", action="store_true", help="train, SIGKILL, resume from last, compare")
    p.add_argument("--root", default=os.path.join("runs", "lightning"), help="checkpoint directory")
    p.add_argument("--preset", default="small", choices=sorted(common.PRESETS))
    p.add_argument("--data", default=None, help="text file or folder (default: Python's docs)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default 300; demo 150)")
    p.add_argument("--ckpt-every", type=int, default=25, help="steps between checkpoints")
    p.add_argument("--mode", default=None,
                   help="GoCkpt mode: auto, sync, async, lazy, gockpt, gockpt_o (default auto; demo gockpt)")
    p.add_argument("--overlap-steps", type=int, default=None,
                   help="force K, the steps one checkpoint's copy spans (multi-step modes)")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default=None, help='checkpoint path, or "last"')
    p.add_argument("--print-every", type=int, default=10, help="steps between loss lines")
    args = p.parse_args(argv)
    if args.max_steps is None:
        args.max_steps = 150 if args.demo else 300
    if args.mode is None:
        args.mode = "gockpt" if args.demo else "auto"
        if args.demo and args.overlap_steps is None:
            args.overlap_steps = 3
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.demo:
        if args.root == os.path.join("runs", "lightning"):
            args.root = os.path.join("runs", "lightning-demo")
        demo(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
