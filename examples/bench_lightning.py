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
checkpoint, the difference of two processes (the main table's per-step stall is finer).
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
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=args.interval,
        enable_checkpointing=variant != "none", default_root_dir=root, plugins=plugins, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(lightning_module(model, optimizer, loader))
    wall = time.perf_counter() - start
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state += sum(t.numel() * t.element_size() for st in optimizer.state.values()
                 for t in st.values() if isinstance(t, torch.Tensor))
    Path(result_path).write_text(json.dumps({
        "variant": variant, "wall_s": wall, "checkpoints": epochs if variant != "none" else 0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "state_bytes": state, "global_step": trainer.global_step,
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


def section(results: list[dict], interval: int) -> str:
    """The markdown section of these results."""
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
        "before `fit` returns.",
        "",
        "| variant | fit (s) | wall above none / ckpt (s) | peak RSS (MB) | peak RSS above none (ckpts) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        extra = "-" if not r["checkpoints"] else f"{(r['wall_s'] - base_wall) / r['checkpoints']:.3f}"
        lines.append(f"| {LABELS[r['variant']]} | {r['wall_s']:.2f} | {extra} | "
                     f"{r['peak_rss_bytes'] / 1e6:.0f} | {(r['peak_rss_bytes'] - base_rss) / size:.2f} |")
    spread = (max(r["wall_s"] for r in nones) - min(r["wall_s"] for r in nones))
    lines += ["", f"Noise: the two `none` runs differ by {spread:.2f} s of fit time "
              f"({spread / max(1, max(r['checkpoints'] for r in results)):.3f} s per checkpoint).", ""]
    return "\n".join(lines)
