"""A tiny deterministic Lightning job for the adapter tests, in-process or as a subprocess.

The model has dropout (its RNG state is checkpointed through ``on_save_checkpoint``, so the
non-tensor state must be taken at the captured step), BatchNorm (buffers), AdamW and a per-step
LR scheduler; the data is a sized, stateful iterable (Lightning checkpoints its position), so a
resumed run repeats the uninterrupted run's batches, losses and updates bit for bit.

As a script (``python _lightning_train.py CONFIG.json``) it runs :func:`fit` once per config
in the JSON list, prints ``ready`` at step ``gate_step`` once the checkpoint named ``gate_path`` is
durable and then blocks on stdin (the parent kills it there), and writes
:func:`results` to ``results_path`` when it finishes (rank 0).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

NUM_BATCHES = 10  # batches per epoch per rank
BATCH_SIZE = 8


class Batches:
    """Sized, stateful iterable: epoch ``e`` yields a permutation (seeded by ``e``) of fixed samples.

    Each item is a (BATCH_SIZE, 16) float32 tensor; ranks take interleaved slices.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        g = torch.Generator().manual_seed(123)
        self.data = torch.randn(world_size * NUM_BATCHES * BATCH_SIZE, 16, generator=g)
        self.rank, self.world_size = rank, world_size
        self.epoch, self.pos = 0, 0

    def __len__(self) -> int:
        return NUM_BATCHES

    def __iter__(self):
        if self.pos >= NUM_BATCHES:
            self.epoch, self.pos = self.epoch + 1, 0
        perm = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(1000 + self.epoch))
        while self.pos < NUM_BATCHES:
            start = (self.pos * self.world_size + self.rank) * BATCH_SIZE
            self.pos += 1
            yield self.data[perm[start : start + BATCH_SIZE]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


class TinyNet(pl.LightningModule):
    """Regression 8 -> 8 with dropout and BatchNorm; records each batch's loss by global batch index."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(32, 8))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = (self.net(batch[:, :8]).float() - batch[:, 8:]).pow(2).mean()
        self.losses[self.trainer.fit_loop.epoch_loop.total_batch_idx] = loss.item()
        self.log("score", float(self.trainer.global_step))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Batches:
        return Batches(self.trainer.global_rank, self.trainer.world_size)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["rng_state"])


class Crash(RuntimeError):
    """Raised inside training to stop a run the hard way (in-process)."""


class CrashAfter(Callback):
    """Raises :class:`Crash` at the start of the first batch after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            raise Crash(f"stopped after step {self.step}")


class GateThenBlock(Callback):
    """Subprocess kill point: at step ``step``, wait until ``path`` and every save requested
    before the latest request (``last.ckpt`` beside it with ``save_last=True``) are durable,
    print, block."""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from gockpt.storage import is_complete

        if trainer.global_step != self.step:
            return
        # Their persists run on, independent of training (slow on a loaded machine).
        pending = list(trainer.strategy.checkpoint_io._callback._pending)
        latest = max((h.requested_step for h in pending), default=0)
        for h in pending:
            if h.requested_step < latest or h.path == self.path:
                h.result(60)
        assert is_complete(self.path), f"{self.path} was never requested"
        print(f"ready {trainer.global_step}", flush=True)
        sys.stdin.readline()  # blocks until the parent kills this process
        raise SystemExit("the parent closed stdin instead of killing")


def fit(
    root: str,
    *,
    io: Any = None,
    max_steps: int = 24,
    precision: str = "32-true",
    accumulate: int = 1,
    clip: float | None = 0.5,
    ckpt_every: int | None = None,
    ckpt_path: str | None = None,
    save_last: bool | str = False,
    save_top_k: int = -1,
    monitor: str | None = None,
    callbacks: tuple = (),
    logger: Any = False,
    strategy: str = "auto",
    devices: int = 1,
    weights_only: bool | None = None,
    checkpoint_kwargs: dict | None = None,
) -> tuple[pl.Trainer, TinyNet]:
    """Train :class:`TinyNet` (seed 0) to ``max_steps``; returns the trainer and the module."""
    pl.seed_everything(0, verbose=False)
    model = TinyNet()
    cbs = list(callbacks)
    if ckpt_every is not None:
        cbs.append(ModelCheckpoint(
            dirpath=root, filename="{step}", every_n_train_steps=ckpt_every, save_top_k=save_top_k,
            save_last=save_last, monitor=monitor, mode="max", **(checkpoint_kwargs or {})))
    trainer = pl.Trainer(
        default_root_dir=root, max_steps=max_steps, precision=precision, accelerator="cpu",
        devices=devices, strategy=strategy, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip, limit_val_batches=0, logger=logger, callbacks=cbs,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in cbs), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, plugins=[io] if io is not None else None,
        log_every_n_steps=1)
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=weights_only)
    return trainer, model


def results(trainer: pl.Trainer, model: TinyNet) -> dict[str, Any]:
    """Final parameters, optimizer state, losses and step of a finished run (deep copies)."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": _clone(trainer.optimizers[0].state_dict()),
        "losses": dict(model.losses),
        "global_step": trainer.global_step,
    }


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def assert_bitwise_equal(got: Any, want: Any, where: str = "") -> None:
    """Bit-for-bit equality of nested dicts/lists of tensors (sparse ones too) and plain values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape and got.layout == want.layout, where
        if want.layout != torch.strided:
            got, want = got.coalesce(), want.coalesce()
            assert_bitwise_equal(got.indices(), want.indices(), f"{where}.indices")
            assert_bitwise_equal(got.values(), want.values(), f"{where}.values")
            return
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys differ {set(got) ^ set(want)}"
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _main(config_path: str) -> None:
    from lightning_gockpt import GoCkptIO

    with open(config_path) as f:
        runs = json.load(f)
    for cfg in runs:  # several runs share one launch (and one DDP process group)
        callbacks = []
        if "gate_path" in cfg:
            callbacks.append(GateThenBlock(cfg.pop("gate_path"), cfg.pop("gate_step")))
        results_path = cfg.pop("results_path", None)
        io = GoCkptIO(**cfg.pop("io")) if "io" in cfg else None
        trainer, model = fit(cfg.pop("root"), io=io, callbacks=tuple(callbacks), **cfg)
        if results_path is not None and trainer.is_global_zero:
            torch.save(results(trainer, model), results_path)
    print("finished", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
