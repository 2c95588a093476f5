"""A ``ModelParallelStrategy`` (FSDP2) GoCkpt checkpoint saved by 2 processes, restored by 1 and 4.

The 2-process run (gloo on CPU) records the gathered model and optimizer state after every step
and checkpoints mid-epoch in ``gockpt_o`` with K = 3; one process assembles the checkpoint with
``gockpt.dcp.load_full``, and 4 processes resume from it with Lightning's
``fit(ckpt_path=...)`` (``torch.distributed.checkpoint`` reshards 2 shards into 4). Both must
hold the recorded state of the captured step, bit for bit.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _dist import end_rank, lightning_rank, spawn
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from test_lightning_sharded import Net, _equal, _full, _port, _Record

from gockpt.dcp import load_full
from lightning_gockpt import GoCkptIO

STOP = 7  # the 2-process run stops here
EVERY = 4  # ModelCheckpoint(every_n_train_steps=EVERY): captured at EVERY + K - 1
K = 3


def _net() -> Net:
    # 30 rows: shards of 15 on 2 ranks and of 8, 8, 8, 6 on 4 (uneven).
    return Net(width=30)


def _trainer(root: str, world: int, max_steps: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=world, max_steps=max_steps, default_root_dir=root,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        plugins=[GoCkptIO(mode="gockpt_o", min_overlap_steps=K, max_overlap_steps=K)],
        callbacks=list(callbacks), logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))


def _worker(rank: int, world: int, port: int, root: str) -> None:
    lightning_rank(rank, port, world)
    pl.seed_everything(0, verbose=False)
    ckpt = f"{root}/ckpt/step={EVERY}.ckpt"
    if world == 2:
        record = _Record()
        mc = ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=EVERY)
        _trainer(f"{root}/a", world, STOP, [record, mc]).fit(_net())
        if rank == 0:
            torch.save(record.states, f"{root}/ref.pt")
    else:
        # Restored and not trained: max_steps is the checkpoint's step.
        trainer = _trainer(f"{root}/b", world, EVERY + K - 1)
        trainer.fit(_net(), ckpt_path=ckpt)
        assert trainer.global_step == EVERY + K - 1
        weight = trainer.lightning_module.body[0].weight
        assert weight.device_mesh.size() == 4 and weight.to_local().shape[0] == (8, 8, 8, 6)[rank]
        state = _full(trainer)
        if rank == 0:
            torch.save(state, f"{root}/restored-{world}.pt")
    end_rank()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """The 2-process run: its checkpoint folder and the gathered state after every step."""
    root = str(tmp_path_factory.mktemp("reshard"))
    spawn(_worker, args=(2, _port(), root), nprocs=2)
    return root


def test_model_parallel_checkpoint_of_2_ranks_assembles_in_1_process(saved):
    """Saved by 2 FSDP2 ranks (captured at step 6, K=3): load_full in one process holds the
    gathered state of step 6, weights, optimizer state and learning rate."""
    captured = EVERY + K - 1
    ref = torch.load(f"{saved}/ref.pt")[captured]
    full = load_full(f"{saved}/ckpt/step={EVERY}.ckpt")
    assert full.captured_step == captured
    flat = {f"model.{k}": v for k, v in full.model_state_dict.items()}
    flat.update({f"optim.state.{p}.{k}": v for p, st in full.optimizer_state.items() for k, v in st.items()})
    _equal(flat, ref["tensors"], "1 process")
    assert [g["lr"] for g in full.param_groups[0]] == ref["lr"]


def test_model_parallel_checkpoint_of_2_ranks_resumes_with_4(saved):
    """The same checkpoint, ``fit(ckpt_path=...)`` by 4 FSDP2 ranks: each holds a quarter of
    every weight, and gathered they are the state of step 6, optimizer and LR included."""
    captured = EVERY + K - 1
    ref = torch.load(f"{saved}/ref.pt")[captured]
    spawn(_worker, args=(4, _port(), saved), nprocs=4)
    restored = torch.load(f"{saved}/restored-4.pt")
    assert restored["step"] == captured
    _equal(restored["tensors"], ref["tensors"], "4 processes")
    assert restored["lr"] == ref["lr"]
