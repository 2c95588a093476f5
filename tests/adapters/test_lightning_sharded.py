"""``GoCkptIO`` under Lightning's ``ModelParallelStrategy`` (FSDP2), 2 processes over gloo (issue 13).

Each test spawns its ranks (``torch.multiprocessing.spawn``; Lightning sees an external launcher
through ``LOCAL_RANK``): one spawn trains the uninterrupted stock run and the GoCkpt run that
checkpoints mid-epoch, a fresh spawn resumes from that checkpoint with ``fit(ckpt_path=...)``.
A rank that fails an assertion makes ``spawn`` raise with its traceback.
"""

from __future__ import annotations

import os
import socket

import lightning.pytorch as pl
import pytest
import torch
from _dist import end_rank, lightning_rank, spawn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

import gockpt
from gockpt.dcp import load_full
from lightning_gockpt import GoCkptIO

BATCHES = 8  # per epoch and rank
TOTAL = 12  # optimizer steps of the full run (the resume crosses an epoch end)
STOP = 8  # the interrupted run stops here
EVERY = 4  # ModelCheckpoint(every_n_train_steps=EVERY): the checkpoint resumed is step=4.ckpt
K = {"lazy": 1, "gockpt_o": 3}


class Net(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        # 5 output rows: shards of 3 and 2 rows (uneven offsets).
        self.body = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                  nn.Linear(width, 5))
        # A complex buffer (a rotary table) that no safetensors shard holds, turned each step.
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.body, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, t = batch
        with torch.no_grad():
            self.freqs.mul_(torch.polar(torch.ones(()), torch.tensor(0.5)))
        return (self.body(x) - t).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return _Resumable(self.global_rank)


class _Resumable:
    """Batches of 4 of this rank's data in a fixed order, with a position Lightning checkpoints."""

    def __init__(self, rank: int) -> None:
        self.x = torch.randn(BATCHES * 4, 16, generator=torch.Generator().manual_seed(7 + rank))
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


class _ValNet(Net):
    """Net with a validation loop that keeps the gathered weights it validates (collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, torch.Tensor] | None = None

    def validation_step(self, batch, batch_idx):
        if self.seen is None:
            self.seen = {f"model.{k}": v.full_tensor().clone() if hasattr(v, "full_tensor")
                         else v.detach().clone() for k, v in self.state_dict().items()}

    def val_dataloader(self):
        return _Resumable(self.global_rank)


def _full(trainer: pl.Trainer) -> dict:
    """The gathered live state under DCP's keys, plus the learning rates (collective)."""
    module, opt = trainer.lightning_module, trainer.optimizers[0]

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor().clone() if hasattr(t, "full_tensor") else t.detach().clone()

    out = {f"model.{k}": whole(v) for k, v in module.state_dict().items()}
    for name, p in module.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim.state.{name}.{k}"] = whole(v)
    return {"tensors": out, "lr": [g["lr"] for g in opt.param_groups], "step": trainer.global_step}


class _Record(Callback):
    """Keeps the gathered state after every optimizer step (all ranks gather; rank 0 keeps)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states[trainer.global_step] = _full(trainer)


class _Probe(Callback):
    """Checks, in the GoCkpt run, that the save of step 4 returned before it was durable."""

    def __init__(self, path: str, mode: str) -> None:
        self.path, self.mode, self.seen = path, mode, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # ModelCheckpoint requested step=4.ckpt at the end of step 4 (it runs after this hook).
        if trainer.global_step == EVERY + 1 and self.mode == "gockpt_o":
            # Captured at step 6: the request cannot have waited for the checkpoint.
            assert not gockpt.storage.is_complete(self.path), "the save blocked until durable"
            assert os.path.isdir(self.path)  # rank 0's placeholder, for ModelCheckpoint's links
            self.seen = True


def _trainer(root: str, *, max_steps: int, callbacks=(), io=None) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, default_root_dir=root,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[io] if io is not None else None, callbacks=list(callbacks), logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))


def _io(mode: str) -> GoCkptIO:
    return GoCkptIO(mode=mode, min_overlap_steps=K[mode], max_overlap_steps=K[mode])


def _worker(rank: int, port: int, root: str, mode: str, phase: str) -> None:
    lightning_rank(rank, port)
    ckpt = f"{root}/ckpt/step={EVERY}.ckpt"
    if phase == "train":
        # The uninterrupted stock run, recording the gathered state after every step.
        pl.seed_everything(0, verbose=False)
        record = _Record()
        trainer = _trainer(f"{root}/ref", max_steps=TOTAL, callbacks=[record])
        trainer.fit(Net())
        # The GoCkpt run, checkpointed every EVERY steps, stopped at STOP.
        pl.seed_everything(0, verbose=False)
        probe = _Probe(ckpt, mode)
        mc = ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{step}", save_top_k=-1,
                             every_n_train_steps=EVERY)
        # Keeps the newest only: each older checkpoint is removed once the next is committed.
        top = ModelCheckpoint(dirpath=f"{root}/top", filename="top-{step}", save_top_k=1,
                              every_n_train_steps=2)
        trainer = _trainer(f"{root}/a", max_steps=STOP, callbacks=[probe, mc, top], io=_io(mode))
        trainer.fit(Net())
        assert probe.seen == (mode == "gockpt_o")
        assert type(trainer.strategy).__name__ == "GoCkptModelParallelStrategy"
        if rank == 0:
            torch.save(record.states, f"{root}/ref.pt")
    else:
        # A fresh pair of processes validates the mid-epoch checkpoint (the model alone), then
        # resumes from it.
        net = _ValNet()
        pl.Trainer(accelerator="cpu", devices=2, default_root_dir=f"{root}/v", limit_val_batches=1,
                   strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                   plugins=[_io(mode)], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False,
                   ).validate(net, ckpt_path=ckpt)
        if rank == 0:
            torch.save(net.seen, f"{root}/validated.pt")
        pl.seed_everything(0, verbose=False)
        trainer = _trainer(f"{root}/b", max_steps=TOTAL, io=_io(mode))
        trainer.fit(Net(), ckpt_path=ckpt)
        final = _full(trainer)
        if rank == 0:
            torch.save(final, f"{root}/resumed.pt")
    end_rank()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)


@pytest.mark.parametrize("mode", list(K))
def test_model_parallel_mid_epoch_resume_is_exact(tmp_path, mode):
    """2-rank FSDP2 under ModelParallelStrategy with GoCkptIO: a checkpoint requested at step 4
    (captured at 4 in lazy, at 6 in gockpt_o with K=3), resumed by a fresh 2-process run, ends
    bit-identical to the uninterrupted stock run; load_full of it in one process equals the
    gathered state at its captured step, and so does the model `Trainer.validate` loads from it
    (the model alone). The model's complex buffer (which every save refused
    before) is kept in the parts and restored."""
    root = str(tmp_path)
    spawn(_worker, args=(_port(), root, mode, "train"), nprocs=2)
    ref = torch.load(f"{root}/ref.pt")
    path = f"{root}/ckpt/step={EVERY}.ckpt"
    full = load_full(path)
    captured = EVERY + K[mode] - 1
    assert full.captured_step == captured
    flat = {f"model.{k}": v for k, v in full.model_state_dict.items()}
    flat.update({f"optim.state.{p}.{k}": v for p, st in full.optimizer_state.items() for k, v in st.items()})
    _equal(flat, ref[captured]["tensors"], "load_full")
    assert [g["lr"] for g in full.param_groups[0]] == ref[captured]["lr"]
    lightning = full.extra["lightning"]  # rank 0's part: Lightning's dict at the captured step
    assert lightning["global_step"] == captured and "state_dict" not in lightning
    fit_loop = lightning["loops"]["fit_loop"]
    assert fit_loop["epoch_loop.batch_progress"]["total"]["processed"] == captured
    assert fit_loop["state_dict"]["combined_loader"] == [{"pos": captured}]  # this rank's data position
    assert gockpt.load_checkpoint(f"{root}/ckpt/step={EVERY}.ckpt/rank-00001").extra is None
    assert load_full(f"{root}/ckpt/step={STOP}.ckpt").captured_step == STOP
    assert os.listdir(f"{root}/top") == [f"top-step={STOP}.ckpt"]
    assert load_full(f"{root}/top/top-step={STOP}.ckpt").captured_step == STOP
    spawn(_worker, args=(_port(), root, mode, "resume"), nprocs=2)
    validated = torch.load(f"{root}/validated.pt")  # Trainer.validate(ckpt_path=...): the model
    _equal(validated, {k: v for k, v in ref[captured]["tensors"].items() if k.startswith("model.")},
           "validate")
    resumed = torch.load(f"{root}/resumed.pt")
    assert resumed["step"] == TOTAL
    _equal(resumed["tensors"], ref[TOTAL]["tensors"], "resumed")
    assert resumed["lr"] == ref[TOTAL]["lr"]


def test_every_lightning_strategy_that_bypasses_checkpoint_io_has_a_path():
    """Which GoCkpt path each strategy takes (the GPU-only ones are exercised in
    test_lightning_fsdp and test_lightning_deepspeed, marked cuda)."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        SingleDeviceStrategy,
    )

    from lightning_gockpt import sharded

    assert sharded.strategy_kind(ModelParallelStrategy()) == "sharded"
    assert sharded.strategy_kind(FSDPStrategy()) == "gathered"  # state_dict_type="full", the default
    assert sharded.strategy_kind(FSDPStrategy(state_dict_type="sharded")) == "fsdp_sharded"
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # the deepspeed package is not needed
    assert sharded.strategy_kind(deepspeed) == "deepspeed"  # a DDPStrategy subclass, yet not replicated
    assert sharded.strategy_kind(DDPStrategy()) == "replicated"
    assert sharded.strategy_kind(SingleDeviceStrategy("cpu")) is None


class _Swap(Callback):
    """Replaces the optimizers by SGD at the batch start of step ``swap`` (every rank)."""

    def __init__(self, swap: int) -> None:
        self.swap = swap

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.swap:
            trainer.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.01, momentum=0.9)]


def _swap_worker(rank: int, port: int, root: str, swap: int) -> None:
    lightning_rank(rank, port)
    pl.seed_everything(0, verbose=False)
    record = _Record()
    _trainer(f"{root}/ref", max_steps=12, callbacks=[_Swap(swap), record]).fit(Net())
    pl.seed_everything(0, verbose=False)
    mc = ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=5)
    _trainer(f"{root}/a", max_steps=12, callbacks=[_Swap(swap), mc], io=_io("gockpt_o")).fit(Net())
    if rank == 0:
        torch.save(record.states, f"{root}/ref.pt")
    end_rank()


@pytest.mark.parametrize("swap", [3])
def test_model_parallel_optimizers_replaced_mid_run_are_followed(tmp_path, swap):
    """``trainer.optimizers = [SGD(...)]`` at the batch start of step ``swap`` under
    ModelParallelStrategy: the engines of both ranks are rebuilt over the new optimizer, so
    each checkpoint holds the gathered state of one step, recorded as Lightning's. Saves are
    requested at steps 5 and 10 (K = 3, captured at 7 and 12): with the swap at 3 both are
    taken by the rebuilt engines; with the swap at 6 the new optimizer's update would run past
    step 5's save before its captured step, and it is not written (it was torn; the DDP test
    test_ddp_mid_run_optimizers_replaced_are_followed runs that case, through the same code)."""
    root = str(tmp_path)
    spawn(_swap_worker, args=(_port(), root, swap), nprocs=2)
    ref = torch.load(f"{root}/ref.pt")
    names = sorted(os.listdir(f"{root}/ckpt"))
    assert names == (["step=10.ckpt", "step=5.ckpt"] if swap == 3 else ["step=10.ckpt"])
    for name in names:
        full = load_full(f"{root}/ckpt/{name}")
        captured = int(name[5:-5]) + 2
        assert full.captured_step == captured == full.extra["lightning"]["global_step"], name
        flat = {f"model.{k}": v for k, v in full.model_state_dict.items()}
        flat.update({f"optim.state.{p}.{k}": v for p, st in full.optimizer_state.items() for k, v in st.items()})
        _equal(flat, ref[captured]["tensors"], name)
