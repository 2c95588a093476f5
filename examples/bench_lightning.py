"""Lightning's defaults in the benchmark: a real ``Trainer``, its default ``ModelCheckpoint``.

The main table of ``benchmark.py`` drives each checkpoint I/O from a plain loop. This section
trains the same model (``fp32`` workload) in a ``lightning.pytorch.Trainer`` instead, one
process per variant, with everything left at Lightning's defaults: automatic optimization and
the default ``ModelCheckpoint`` (a checkpoint at the end of every epoch, ``save_top_k=1``: the
newest is kept, the one before deleted). An epoch is ``--interval`` batches
(``limit_train_batches``), so a checkpoint is taken every ``--interval`` steps. Variants:

- ``none``: ``enable_checkpointing=False`` (run twice: the run-to-run noise);
- ``torch``: stock ``TorchCheckpointIO``;
- ``async``: ``AsyncCheckpointIO``;
- ``gockpt``: ``GoCkptIO()`` with its defaults.

Reported per variant: peak RSS (``ru_maxrss``) above the smaller ``none`` run, in checkpoint sizes
(weights + optimizer state), and the wall time of ``fit`` above the mean ``none`` run per
checkpoint, the difference of two processes (the main table's per-step stall is finer). That
time is split three ways (a callback times every batch): before the first batch (set-up), the
loop (first batch start to last batch end: the steps and the epoch ends' saves) and after the
last batch (until ``fit`` returns: every variant waits there until the checkpoint of the last
epoch end is written). A non-blocking save can hide the loop's share, not the wait for the last
checkpoint: that is bounded below by the time to write one checkpoint, given beside it from the
main benchmark's raw write+fsync bandwidth when known.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "torch", "async", "gockpt", "none")


def lightning_module(model: Any, optimizer: Any, loader: Any) -> Any:
    """A LightningModule training ``model`` (a ``workload`` language model) with ``optimizer``
    on ``loader``."""
    import lightning.pytorch as pl
    from workload import lm_loss

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            return lm_loss(self.net, batch)

        def configure_optimizers(self):
            return optimizer

        def train_dataloader(self):
            return loader

    return Module()


def batch_times() -> Any:
    """A Lightning callback noting ``time.perf_counter()`` (seconds) at every batch start and
    end (``starts``, ``ends``) and at the end of training (``train_end``). Lightning is
    imported here, so that this module imports without it."""
    import lightning.pytorch as pl

    class Times(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.train_end: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.train_end = time.perf_counter()

    return Times()


def run_variant(args: argparse.Namespace, variant: str, root: str, result_path: str) -> None:
    """Train one variant in this (forked) process and write its measurements to ``result_path``."""
    import resource
    import warnings

    import lightning.pytorch as pl
    import torch
    from workload import PRESETS, build_training, make_dataloader, text_datasets

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    preset = PRESETS[args.preset]
    model, optimizer, _ = build_training("fp32", args.preset, seed=0)
    train, _ = text_datasets(args.data, seq_len=preset.seq_len)
    loader = make_dataloader(train, args.batch_size or preset.batch_size, seed=0)

    plugins = None
    if variant == "async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins = [AsyncCheckpointIO()]
    elif variant == "gockpt":
        from lightning_gockpt import GoCkptIO

        plugins = [GoCkptIO()]
    epochs = max(1, args.steps // args.interval)
    times = batch_times()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=args.interval,
        enable_checkpointing=variant != "none", default_root_dir=root, plugins=plugins, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[times])
    start = time.perf_counter()
    trainer.fit(lightning_module(model, optimizer, loader))
    end = time.perf_counter()
    wall = end - start
    steps = [b - a for a, b in zip(times.starts, times.ends, strict=True)]
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state += sum(t.numel() * t.element_size() for st in optimizer.state.values()
                 for t in st.values() if isinstance(t, torch.Tensor))
    Path(result_path).write_text(json.dumps({
        "variant": variant, "wall_s": wall, "checkpoints": epochs if variant != "none" else 0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "state_bytes": state, "global_step": trainer.global_step,
        "before_s": times.starts[0] - start, "loop_s": times.ends[-1] - times.starts[0],
        "after_s": end - times.ends[-1], "steps_s": sum(steps),
    }))


def run_all(args: argparse.Namespace, fork, root: str) -> list[dict]:
    """Every variant in its own forked process, in :data:`VARIANTS` order."""
    results = []
    for i, variant in enumerate(VARIANTS):
        result_path = os.path.join(root, f"lightning-{i}.json")
        work = os.path.join(root, f"lightning-{i}")
        process = fork.Process(target=run_variant, args=(args, variant, work, result_path))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"Lightning variant {variant!r} failed (exit code {process.exitcode})")
        os.sync()
        results.append(json.loads(Path(result_path).read_text()))
        r = results[-1]
        print(f"lightning-{variant}: fit {r['wall_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB", flush=True)
    return results


LABELS = {"none": "no checkpoint", "torch": "TorchCheckpointIO (stock)", "async": "AsyncCheckpointIO",
          "gockpt": "GoCkptIO()"}


def section(results: list[dict], interval: int, write_gbps: float | None = None) -> str:
    """The markdown section of these results; ``write_gbps``: the machine's raw write+fsync
    bandwidth (GB/s) measured in the same run, for the floor of the wait after the last batch."""
    nones = [r for r in results if r["variant"] == "none"]
    base_rss = min(r["peak_rss_bytes"] for r in nones)
    base_wall = statistics.mean(r["wall_s"] for r in nones)
    size = nones[0]["state_bytes"]
    lines = [
        "## Lightning's defaults",
        "",
        f"A `Trainer` with its default `ModelCheckpoint` (one checkpoint per epoch of {interval} "
        f"steps, `save_top_k=1`), {results[0]['global_step']} steps, each variant in its own process "
        f"(`examples/bench_lightning.py`); checkpoint size {size / 1e6:.0f} MB (weights + AdamW state). "
        "Fit time includes waiting for the last checkpoint to be written, as every variant does "
        "before `fit` returns. Fit is split into the time before the first batch, the loop (first "
        "batch start to last batch end: the steps and the saves at the epoch ends) and the time "
        "after the last batch (the wait for the last checkpoint).",
        "",
        "| variant | fit (s) | wall above none / ckpt (s) | before 1st batch (s) | loop (s) | "
        "of it, steps (s) | loop above none / ckpt (s) | after last batch (s) | peak RSS (MB) "
        "| peak RSS above none (ckpts) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    has_split = all("loop_s" in r for r in results)
    base_loop = statistics.mean(r["loop_s"] for r in nones) if has_split else 0.0
    base_after = statistics.mean(r["after_s"] for r in nones) if has_split else 0.0
    for r in results:
        n = r["checkpoints"]
        extra = "-" if not n else f"{(r['wall_s'] - base_wall) / n:.3f}"
        if has_split:
            loop_extra = "-" if not n else f"{(r['loop_s'] - base_loop) / n:.3f}"
            split = (f"{r['before_s']:.2f} | {r['loop_s']:.2f} | {r['steps_s']:.2f} | {loop_extra} | "
                     f"{r['after_s']:.2f}")
        else:
            split = "- | - | - | - | -"
        lines.append(f"| {LABELS[r['variant']]} | {r['wall_s']:.2f} | {extra} | {split} | "
                     f"{r['peak_rss_bytes'] / 1e6:.0f} | {(r['peak_rss_bytes'] - base_rss) / size:.2f} |")
    spread = (max(r["wall_s"] for r in nones) - min(r["wall_s"] for r in nones))
    count = max(1, max(r["checkpoints"] for r in results))
    lines += ["", f"Noise: the two `none` runs differ by {spread:.2f} s of fit time "
              f"({spread / count:.3f} s per checkpoint)"]
    if has_split:
        loop_spread = max(r["loop_s"] for r in nones) - min(r["loop_s"] for r in nones)
        lines[-1] += f", by {loop_spread:.2f} s of loop time ({loop_spread / count:.3f} s per checkpoint)."
        if write_gbps:
            floor = size / (write_gbps * 1e9)
            tails = ", ".join(f"{LABELS[r['variant']]} {r['after_s'] - base_after:.2f} s"
                              for r in results if r["checkpoints"] and r["variant"] != "torch")
            lines += ["", f"After the last batch, above none: {tails}. A save that does not block "
                      f"the loop cannot end sooner than the last checkpoint's write: {floor:.2f} s for "
                      f"{size / 1e6:.0f} MB at this machine's raw write+fsync bandwidth "
                      f"({write_gbps:.2f} GB/s, main table), {floor / count:.3f} s per checkpoint "
                      f"over this run's {count}."]
    else:
        lines[-1] += "."
    lines.append("")
    return "\n".join(lines)
