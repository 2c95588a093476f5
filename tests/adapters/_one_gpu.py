"""A tiny Lightning job for the one-GPU strategy tests (FSDPStrategy, DeepSpeedStrategy).

Each test runs its scenario in a child process (its own file as a script, through
:func:`run_child`): Lightning initializes a NCCL process group there, which must not leak into
the other tests of a pytest worker.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import torch
from torch import nn

BATCHES = 6  # per epoch


class Data:
    """Sized, stateful batches in a fixed order (Lightning checkpoints the position)."""

    def __init__(self) -> None:
        self.x = torch.randn(BATCHES * 4, 16, generator=torch.Generator().manual_seed(7))
        self.pos = 0

    def __len__(self) -> int:
        return BATCHES

    def __iter__(self):
        if self.pos >= BATCHES:
            self.pos = 0
        while self.pos < BATCHES:
            b = self.x[self.pos * 4:(self.pos + 1) * 4]
            self.pos += 1
            yield b, b[:, :5].flip(1)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class Net(pl.LightningModule):
    """Two linear layers, AdamW and a per-step LR scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))

    def training_step(self, batch, batch_idx):
        x, t = batch
        return (self.body(x) - t).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return Data()


def to_cpu(tree):
    """``tree`` with every tensor on the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_cpu(v) for v in tree]
    return tree


def run_child(script: str, *args: str, ok: str) -> None:
    """Run ``script`` with ``args`` in a fresh process (deterministic cuBLAS); it must print ``ok``."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", MASTER_ADDR="127.0.0.1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and ok in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
