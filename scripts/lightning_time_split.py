"""Where GoCkptIO's extra fit time goes under Lightning's defaults (docs/benchmark.md).

The ``bench`` preset under a Trainer with its default ModelCheckpoint (6 epochs of 10 steps, a
checkpoint per epoch end), timed per batch: the steps, the gaps between batches (ModelCheckpoint
saves at the epoch ends), the time before the first batch and after the last one.

    python scripts/lightning_time_split.py none|gockpt
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_lightning import batch_times, lightning_module  # noqa: E402
from workload import PRESETS, build_training, make_dataloader, text_datasets  # noqa: E402

EPOCHS, STEPS_PER_EPOCH = 6, 10


def main(variant: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    preset = PRESETS["bench"]
    model, optimizer, _ = build_training("fp32", "bench", seed=0)
    train, _ = text_datasets(None, seq_len=preset.seq_len)
    loader = make_dataloader(train, preset.batch_size, seed=0)

    plugins = None
    if variant == "gockpt":
        from lightning_gockpt import GoCkptIO

        plugins = [GoCkptIO()]
    root = os.path.join(tempfile.gettempdir(), f"gockpt_time_split_{variant}")
    shutil.rmtree(root, ignore_errors=True)
    times = batch_times()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, limit_train_batches=STEPS_PER_EPOCH,
        enable_checkpointing=variant != "none", default_root_dir=root, plugins=plugins, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[times])
    t0 = time.perf_counter()
    trainer.fit(lightning_module(model, optimizer, loader))
    t1 = time.perf_counter()
    starts, ends, train_end = times.starts, times.ends, times.train_end
    steps = [b - a for a, b in zip(starts, ends, strict=True)]
    gaps = [starts[i + 1] - ends[i] for i in range(len(ends) - 1)]
    epoch_gaps = [round(g, 3) for i, g in enumerate(gaps) if (i + 1) % STEPS_PER_EPOCH == 0]
    print(f"{variant}: fit {t1 - t0:.2f} s; before the first batch {starts[0] - t0:.3f} s; steps "
          f"{sum(steps):.2f} s (median {statistics.median(steps):.3f}); gaps between batches "
          f"{sum(gaps):.2f} s, at the epoch ends {epoch_gaps}; last batch end to train end "
          f"{train_end - ends[-1]:.3f} s; train end to fit's return {t1 - train_end:.3f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gockpt")
