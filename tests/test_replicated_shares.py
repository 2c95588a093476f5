"""DDP ranks share the write of the replicated state (issue 13, item 3): 2 processes over gloo.

Each rank's engine stores a distinct share of the units (a parameter with its optimizer state),
balanced by bytes; rank 0 also stores the buffers; the parts are committed together and load
through ``gockpt.dcp`` with any number of ranks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from _dist import end_rank, spawn
from test_sharded import _equal, _full, _init, _port
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gockpt
from gockpt import storage
from gockpt.dcp import load_full, load_sharded
from gockpt.layout import build_layout
from gockpt.partition import balance, partition_layout, prune_model, prune_optimizer
from gockpt.sharded import ReplicasDifferError, ShardedEngine, part_name, sharding_name

STEPS = 9
BUFFERS = {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Enough units that each of 2 ranks holds 3 or more (K is at most a rank's unit count).
    hidden = [layer for _ in range(5) for layer in (nn.Tanh(), nn.Linear(32, 32))]
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), *hidden, nn.Tanh(), nn.Linear(32, 5))


def _setup() -> tuple[DDP, torch.optim.Optimizer]:
    ddp = DDP(_model())
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)


def _step(ddp: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
    ((ddp(x) - y) ** 2).mean().backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


def _mine(state: dict, rank: int) -> dict:
    # Buffers are rank 0's: DDP broadcasts them from rank 0 at the next forward.
    return state if rank == 0 else {k: v for k, v in state.items() if k not in BUFFERS}


def _train_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    ddp, opt = _setup()
    cfg = gockpt.GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3)
    eng = ShardedEngine(ddp, opt, cfg, commit_timeout_s=30, replicated=True)
    m = ddp.module
    saves, live = {}, {}
    for step in range(STEPS):
        _step(ddp, opt, step)
        eng.step_end()
        if step == 1:
            saves["lazy"] = eng.save(f"{root}/lazy", mode="lazy", state_fn=lambda: {"rank": rank})
        if step == 3:
            saves["gockpt_o"] = eng.save(f"{root}/gockpt_o", state_fn=lambda: {"rank": rank})
        for name, h in saves.items():
            target = h.part.metrics.requested_step + h.part.metrics.num_overlap_steps - 1
            if target == eng.version and name not in live:
                live[name] = (target, _full(m, opt))
    eng.wait()
    metrics = {name: h.part.metrics for name, h in saves.items()}
    assert (metrics["gockpt_o"].mode, metrics["gockpt_o"].num_overlap_steps) == ("gockpt_o", 3), metrics
    assert metrics["lazy"].mode == "lazy" and metrics["lazy"].num_overlap_steps == 1
    final = _full(m, opt)
    eng.close()
    torch.save({"live": live, "final": final,
                "state_bytes": {n: x.state_bytes for n, x in metrics.items()}}, f"{root}/expected-{rank}.pt")
    assert gockpt.latest_checkpoint(root).endswith("gockpt_o")
    end_rank()


def _resume_worker(rank: int, world: int, port: int, root: str) -> None:
    """A fresh 2-process run resumed from each checkpoint ends bit-identical."""
    _init(rank, world, port)
    expected = torch.load(f"{root}/expected-{rank}.pt")
    for name, (target, state) in expected["live"].items():
        ddp, opt = _setup()
        extra = load_sharded(f"{root}/{name}", ddp.module, opt)
        assert extra == {"rank": rank}
        _equal(_mine(_full(ddp.module, opt), rank), _mine(state, rank), f"{name} loaded on rank {rank}")
        for step in range(target, STEPS):
            _step(ddp, opt, step)
        _equal(_full(ddp.module, opt), expected["final"], f"{name} resumed on rank {rank}")
    end_rank()


def _nbytes(info: dict) -> int:
    dtype = getattr(torch, info["dtype"])
    return torch.Size(info["global_shape"]).numel() * torch.empty((), dtype=dtype).element_size()


def test_ddp_ranks_share_the_write_and_resume_exact(tmp_path):
    """lazy and gockpt_o (K=3) checkpoints of a 2-rank DDP run: each rank writes a disjoint half
    of the state, the parts together hold every tensor once, a fresh 2-rank run resumes
    bit-identical, and one process assembles the live state at the captured step."""
    root = str(tmp_path)
    spawn(_train_worker, args=(2, _port(), root), nprocs=2)
    exp = [torch.load(f"{root}/expected-{r}.pt") for r in range(2)]
    for name, (target, state) in exp[0]["live"].items():
        path = f"{root}/{name}"
        shares = [json.load(open(os.path.join(path, sharding_name(r)))) for r in range(2)]
        fqns = [{i["fqn"] for i in sh["tensors"].values()} for sh in shares]
        assert fqns[0].isdisjoint(fqns[1]), name
        assert fqns[0] | fqns[1] == set(state), (name, sorted(set(state) ^ (fqns[0] | fqns[1])))
        assert BUFFERS <= fqns[0]
        sizes = [sum(_nbytes(i) for i in sh["tensors"].values()) for sh in shares]
        total = sum(sizes)
        for r, (sh, b) in enumerate(zip(shares, sizes, strict=True)):
            assert 0.4 * total <= b <= 0.6 * total, (name, r, sizes)
            part = os.path.join(path, part_name(r))
            manifest = storage.read_manifest(gockpt.fsutil.url_to_fs(part, None)[0], part)
            # Nothing but the owned tensors is stored in the part: no copy of another rank's.
            assert set(manifest["tensors"]) == set(sh["tensors"]), (name, r)
            for key, info in sh["tensors"].items():
                assert info["replica"] == 0 and info["placements"] is None
                assert info["offsets"] == [0] * len(info["global_shape"])
                assert info["global_shape"] == manifest["tensors"][key]["shape"]
            loaded = gockpt.load_checkpoint(part)
            mine = {f"model.{k}" for k, v in loaded.model_state_dict.items() if isinstance(v, torch.Tensor)}
            assert mine == {f for f in fqns[r] if f.startswith("model.")}, (name, r)
            assert loaded.captured_step == target
            # The D2H copy of each rank was its own share only.
            assert exp[r]["state_bytes"][name] == b, (name, r)
        full = load_full(path)
        assert full.captured_step == target and full.extra == {"rank": 0}
        flat = {f"model.{k}": v for k, v in full.model_state_dict.items()}
        flat.update({f"optim.state.{p}.{k}": v for p, st in full.optimizer_state.items() for k, v in st.items()})
        _equal(flat, state, f"{name} loaded by 1 process")
        assert full.param_groups[0][0]["lr"] == 1e-2
    spawn(_resume_worker, args=(2, _port(), root), nprocs=2)


def test_partition_is_balanced_deterministic_and_covers_every_tensor():
    """The shares of 3 ranks: disjoint, covering, buffers on rank 0, the same when rebuilt."""
    assert balance([5, 1, 4, 4, 2], 2) == balance([5, 1, 4, 4, 2], 2) == [0, 0, 1, 1, 0]
    assert balance([3, 3], 2, [10, 0]) == [1, 1]
    with pytest.raises(ValueError):
        balance([1], 2, [0])
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 16)).sum().backward()
    opt.step()
    full = build_layout(m, [opt])
    parts = [partition_layout(full, r, 3) for r in range(3)]
    keys = [{e.key for e in p.entries} for p in parts]
    assert sum(len(k) for k in keys) == len(full.entries)
    assert set().union(*keys) == {e.key for e in full.entries}
    assert {e.key for e in parts[0].static} == BUFFERS and not parts[1].static
    assert [p.partition.owners for p in parts] == [partition_layout(build_layout(m, [opt]), 0, 3).partition.owners] * 3
    sizes = [sum(e.spec.nbytes for e in p.entries) for p in parts]
    assert max(sizes) - min(sizes) <= max(u.state_bytes for u in full.units), sizes
    # The state trees of rank 1 keep its own parameters and optimizer state only.
    p1 = parts[1].partition
    sd = prune_model(m.state_dict(), p1)
    assert {f"model.{k}" for k in sd} == {u.param_entry.key for u in parts[1].units}
    osd = prune_optimizer(opt.state_dict(), 0, p1)
    assert set(osd["state"]) == {u.param_index for u in parts[1].units}
    assert len(osd["param_groups"]) == 1
    with pytest.raises(ValueError, match="rank"):
        partition_layout(full, 3, 3)


def _mismatch_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), *([nn.Linear(4, 4)] if rank == 1 else []))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    eng = ShardedEngine(m, opt, gockpt.GoCkptConfig(mode="lazy"), commit_timeout_s=30, replicated=True)
    with pytest.raises(RuntimeError, match="same parameters"):
        eng.save(f"{root}/ck")
    assert not os.path.exists(f"{root}/ck")
    eng.close()
    # Replicas that may have drifted apart: shares of them would make no one state.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].requires_grad_(False)  # frozen when DDP wraps it: DDP will not average its gradients
    ddp = DDP(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ShardedEngine(ddp, opt, gockpt.GoCkptConfig(mode="lazy"), commit_timeout_s=30, replicated=True)
    eng.save(f"{root}/same")
    m[1].requires_grad_(True)
    with pytest.raises(ReplicasDifferError, match="1.bias, 1.weight requires gradients now"):
        eng.save(f"{root}/unfrozen")
    m[1].requires_grad_(False)
    opt.param_groups[0]["lr"] = 0.1 if rank == 0 else 0.05  # a schedule stepped on each rank's metric
    with pytest.raises(ReplicasDifferError, match="hyperparameters"):
        eng.save(f"{root}/lr")
    # Compared by value, not by how they print: two tensors printed alike (4 digits) differ...
    opt.param_groups[0]["lr"] = torch.tensor(0.001 if rank == 0 else 0.0010004)
    with pytest.raises(ReplicasDifferError, match="hyperparameters"):
        eng.save(f"{root}/tensor-lr")
    # ... while equal values, and objects of one class (their repr shows each one's address),
    # do not.
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    opt.param_groups[0]["note"] = object()
    eng.save(f"{root}/same-again")
    eng.close()
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["latest", "same", "same-again"]
    # A parameter DDP is told to leave out (never broadcast nor averaged: here each rank starts
    # it from its own seed) is each rank's own, trained or not: shares of it would be no one's.
    torch.manual_seed(rank)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    DDP._set_params_and_buffers_to_ignore_for_model(m, ["1.weight"])
    ddp = DDP(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ShardedEngine(ddp, opt, gockpt.GoCkptConfig(mode="lazy"), commit_timeout_s=30, replicated=True)
    with pytest.raises(ReplicasDifferError, match="1.weight is left out of DDP"):
        eng.save(f"{root}/ignored")
    eng.close()
    assert not os.path.exists(f"{root}/ignored")
    # A layer unfrozen inside a save's copy windows, the save then captured by wait(): each part
    # records its rank's view at its captured step, and the commit does not commit shares of
    # copies that may differ (it did where the capture was not at a step boundary).
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    m[5].requires_grad_(False)
    ddp = DDP(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    config = gockpt.GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3)
    eng = ShardedEngine(ddp, opt, config, commit_timeout_s=30, replicated=True)

    def step():
        ddp(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()

    step()
    h = eng.save(f"{root}/windows")
    assert h.part.metrics.num_overlap_steps == 3
    m[5].requires_grad_(True)
    step()
    eng.wait()  # captured here, at step 2, one update after the unfreeze
    assert h.captured_step == 2 and not os.path.exists(f"{root}/windows")
    assert h.overtaken == (rank == 0)  # rank 0's commit refused it: a warning, not an error
    eng.close()
    end_rank()


def test_replicated_ranks_with_different_states_refuse_to_save(tmp_path):
    """Ranks whose states differ would not partition alike: every rank raises, nothing is
    written. So do ranks whose replicas may differ (a layer DDP does not average now trains,
    the learning rates differ): each rank's share would come from another copy."""
    spawn(_mismatch_worker, args=(2, _port(), str(tmp_path)), nprocs=2)
