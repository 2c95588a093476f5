"""Sharded checkpoints under FSDP2 (issue 13): 2 processes over gloo on the CPU.

Each test spawns its ranks once (``torch.multiprocessing.spawn``); a rank that fails an
assertion makes ``spawn`` raise with its traceback.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import end_rank, spawn
from torch import nn

import gockpt
from gockpt.dcp import load_full, load_sharded
from gockpt.sharded import ShardedEngine
from gockpt.writer import CheckpointWriter

STEPS = 10


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # fully_shard's default mesh is on the accelerator where one exists; these ranks run on CPU.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # 5 output rows: shards of 3 and 2 rows (uneven offsets).
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _step(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
    ((m(x) - y) ** 2).mean().backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)  # clipping over DTensor grads
    opt.step()
    opt.zero_grad()


def _full(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The gathered live state, under DCP's keys (collective)."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor().clone() if hasattr(t, "full_tensor") else t.detach().clone()

    out = {f"model.{k}": whole(v) for k, v in m.state_dict().items()}
    for name, p in m.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim.state.{name}.{k}"] = whole(v)
    return out


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)


def _resume_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = gockpt.GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3)
    eng = ShardedEngine(m, opt, cfg, commit_timeout_s=30)
    saves, live = {}, {}
    for step in range(STEPS):
        _step(m, opt, step)
        eng.step_end()
        if step == 2:
            h = eng.save(f"{root}/lazy", mode="lazy", state_fn=lambda: {"version": eng.version})
            saves["lazy"] = h
        if step == 4:
            h = eng.save(f"{root}/gockpt_o", state_fn=lambda: {"version": eng.version})
            saves["gockpt_o"] = h
        for name, h in saves.items():
            target = h.part.metrics.requested_step + h.part.metrics.num_overlap_steps - 1
            if target == eng.version and name not in live:
                live[name] = (target, _full(m, opt))
    eng.wait()
    # A directory that is not a checkpoint is refused at the request, on every rank, and kept.
    foreign = f"{root}/foreign"
    if rank == 0:
        os.makedirs(foreign)
        with open(f"{foreign}/notes.txt", "w") as f:
            f.write("mine")
    dist.barrier()
    with pytest.raises((FileExistsError, RuntimeError), match="not a checkpoint"):
        eng.save(foreign)
    assert os.listdir(foreign) == ["notes.txt"]
    assert saves["gockpt_o"].part.metrics.num_overlap_steps == 3
    assert saves["gockpt_o"].part.metrics.mode == "gockpt_o"
    assert saves["lazy"].part.metrics.num_overlap_steps == 1
    final = _full(m, opt)
    group = eng._group
    eng.close()
    with pytest.raises(KeyError):  # the engine's own group is destroyed at close
        dist.get_process_group_ranks(group)
    eng.close()  # a second close is a no-op, and so is a wait after it
    assert eng.wait() == []
    with pytest.raises(RuntimeError, match="closed"):  # not a collective on the default group
        eng.save(f"{root}/after-close")
    if rank == 0:
        torch.save({"live": live, "final": final}, f"{root}/expected.pt")
    for name, (target, state) in live.items():
        # Resume with 2 ranks from the checkpoint: equal at the captured step, and at the end.
        m2 = _model()
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
        extra = load_sharded(f"{root}/{name}", m2, opt2)
        assert extra == {"version": target}
        _equal(_full(m2, opt2), state, f"{name} loaded")
        for step in range(target, STEPS):
            _step(m2, opt2, step)
        _equal(_full(m2, opt2), final, f"{name} resumed")
    assert gockpt.latest_checkpoint(root).endswith("gockpt_o")
    end_rank()


def _reload_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    expected = torch.load(f"{root}/expected.pt")
    for name, (_, state) in expected["live"].items():
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        load_sharded(f"{root}/{name}", m, opt)
        _equal(_full(m, opt), state, f"{name} with {world} ranks")
    end_rank()


def test_fsdp2_resume_exact_and_reshard(tmp_path):
    """lazy and gockpt_o (K=3) checkpoints of a 2-rank FSDP2 run: a 2-rank resume ends bit-identical
    to the uninterrupted run; 1 and 4 processes load the same full weights and optimizer state."""
    root = str(tmp_path)
    spawn(_resume_worker, args=(2, _port(), root), nprocs=2)
    expected = torch.load(f"{root}/expected.pt")
    assert set(expected["live"]) == {"lazy", "gockpt_o"}
    for name, (target, state) in expected["live"].items():
        full = load_full(f"{root}/{name}")
        assert full.captured_step == target
        flat = {f"model.{k}": v for k, v in full.model_state_dict.items()}
        flat.update({f"optim.state.{p}.{k}": v for p, st in full.optimizer_state.items() for k, v in st.items()})
        _equal(flat, state, f"{name} loaded by 1 process")
        assert full.param_groups[0][0]["lr"] == 1e-2
        with pytest.raises(ValueError, match="sharded"):
            gockpt.load_checkpoint(f"{root}/{name}")
    spawn(_reload_worker, args=(4, _port(), root), nprocs=4)


class _FailingWriter(CheckpointWriter):
    def before_publish(self, snapshot):
        raise OSError(28, "injected: no space left on device")


class _RowNormSGD(torch.optim.Optimizer):
    """An update that is not elementwise (it normalizes each parameter by its norm)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st["m"] = st.get("m", torch.zeros_like(p)) + p.grad
                    p.sub_(g["lr"] * st["m"] / (st["m"].norm() + 1))


def _fault_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    eng = ShardedEngine(m, opt, gockpt.GoCkptConfig(mode="lazy"), commit_timeout_s=30)
    for step in range(2):
        _step(m, opt, step)
        eng.step_end()
    eng.save(f"{root}/ck-1")
    eng.wait()
    _step(m, opt, 2)
    eng.step_end()
    # Rank 1's part fails in its last phase: no rank may see a complete checkpoint.
    h = eng.save(f"{root}/ck-2", writer=_FailingWriter() if rank == 1 else None)
    _step(m, opt, 2)  # the part's copy window ends at this update; then it is written
    eng.step_end()
    if rank == 1:
        while not h.part.done():  # its error is in: the next boundary would be the first to see it
            time.sleep(0.01)
    # Training goes on: no rank raises the error alone at a boundary, where it would leave the
    # other in its next collective; the next collective of the engine raises it on both.
    _step(m, opt, 3)
    eng.step_end()
    eng.flush()
    with pytest.raises((RuntimeError, OSError), match="injected" if rank == 1 else "rank 1"):
        eng.wait()
    assert not os.path.exists(f"{root}/ck-2")
    assert gockpt.latest_checkpoint(root) == f"{root}/ck-1"
    assert [n for n in os.listdir(root) if "gockpt-tmp" in n] == []
    # The engine goes on: the next save commits.
    _step(m, opt, 4)
    eng.step_end()
    eng.save(f"{root}/ck-3")
    eng.wait()
    assert gockpt.latest_checkpoint(root) == f"{root}/ck-3"
    # Ranks asking for different paths: refused on both, nothing written.
    with pytest.raises(ValueError, match="different paths"):
        eng.save(f"{root}/own-{rank}")
    assert not os.path.exists(f"{root}/own-0") and not os.path.exists(f"{root}/own-1")
    dist.barrier()
    assert [n for n in os.listdir(root) if "gockpt-tmp" in n] == []
    eng.close()
    # An optimizer that is not elementwise on a shard: lazy, with a warning.
    m2 = _model()
    opt2 = _RowNormSGD(m2.parameters())
    _step(m2, opt2, 0)
    eng2 = ShardedEngine(m2, opt2, gockpt.GoCkptConfig(mode="gockpt_o", min_overlap_steps=2,
                                                        max_overlap_steps=2), commit_timeout_s=30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = eng2.save(f"{root}/norm")
    assert any("elementwise" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert h.part.metrics.mode == "lazy" and h.part.metrics.num_overlap_steps == 1
    _step(m2, opt2, 1)
    eng2.close()
    end_rank()


def test_fsdp2_failed_part_leaves_previous_checkpoint(tmp_path):
    """An error on one rank's part: no complete checkpoint, the previous one stays latest and loads."""
    root = str(tmp_path)
    spawn(_fault_worker, args=(2, _port(), root), nprocs=2)
    assert load_full(f"{root}/ck-1").captured_step == 2
    assert load_full(f"{root}/ck-3").captured_step == 6
    assert not os.path.exists(f"{root}/ck-2")


def _close_alone_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    m = nn.Linear(8, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step() -> None:
        m(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    eng = ShardedEngine(m, opt, gockpt.GoCkptConfig(mode="lazy"), replicated=True, commit_timeout_s=30)
    step()
    eng.step_end()
    h = eng.save(f"{root}/ck", writer=_FailingWriter())
    step()
    eng.step_end()
    while not h.part.done():
        time.sleep(0.01)
    step()
    eng.step_end()  # not raised at a boundary (see _fault_worker)
    # The run stops by an exception: the close that does not meet the other ranks raises it.
    with pytest.raises(OSError, match="injected"):
        eng.close(collective=False)
    assert not os.path.exists(f"{root}/ck")
    end_rank()


def test_a_part_error_is_raised_by_a_close_without_the_other_ranks(tmp_path):
    spawn(_close_alone_worker, args=(1, _port(), str(tmp_path)), nprocs=1)


def _overtaken_worker(rank: int, world: int, port: int, root: str, victim: int) -> None:
    _init(rank, world, port)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    config = gockpt.GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3)
    eng = ShardedEngine(m, opt, config, commit_timeout_s=30)
    _step(m, opt, 0)
    eng.step_end()
    eng.save(f"{root}/first", mode="sync")
    _step(m, opt, 1)
    eng.step_end()
    h = eng.save(f"{root}/ck")
    if rank == victim:  # an event of this rank alone (a slot wait timed out, an edit after capture)
        assert eng.abandon_uncaptured("this rank's state moved on") == 1
    for step in range(2, 6):
        _step(m, opt, step)
        eng.step_end()  # no rank raises: the other parts end in a stage still there
    eng.wait()  # no rank raises either: a warning, not an error of the run
    assert h.overtaken == (rank in (0, victim))  # rank 0 learns it from the commit
    assert not os.path.exists(f"{root}/ck")
    assert gockpt.latest_checkpoint(root) == f"{root}/first"
    assert [n for n in os.listdir(root) if "gockpt-tmp" in n] == [], (rank, os.listdir(root))
    dist.barrier()  # both have looked before rank 0 stages the next save
    eng.save(f"{root}/after")  # the engine goes on
    eng.close()
    assert gockpt.latest_checkpoint(root) == f"{root}/after"
    end_rank()


@pytest.mark.parametrize("victim", [0, 1])
def test_a_part_overtaken_on_one_rank_alone_is_not_committed_and_fails_no_rank(tmp_path, victim):
    """A part that one rank alone ends unwritten with a warning (overtaken): the checkpoint is
    not committed, the previous one stays the latest, and neither rank raises, at a step
    boundary or at ``wait`` (rank 0's part overtaken: its commit removed the stage while rank 1
    was still writing, a storage error on rank 1; rank 1's: every rank raised)."""
    spawn(_overtaken_worker, args=(2, _port(), str(tmp_path), victim), nprocs=2)
    assert load_full(f"{tmp_path}/first").captured_step == 1
    assert load_full(f"{tmp_path}/after").captured_step == 6


def _abandon_worker(rank: int, world: int, port: int, root: str) -> None:
    import time

    _init(rank, world, port)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    eng = ShardedEngine(m, opt, gockpt.GoCkptConfig(mode="gockpt", min_overlap_steps=3,
                                                     max_overlap_steps=3), commit_timeout_s=120)
    for step in range(2):
        _step(m, opt, step)
        eng.step_end()
    eng.save(f"{root}/ck")  # to be captured two updates later, on every rank
    flag = f"{root}/rank0-closed"
    if rank == 0:
        # This rank's run fails here. Rank 1 is stuck (in a collective this rank never joins):
        # its part never comes, and the commit must not hold this rank for commit_timeout_s.
        t0 = time.monotonic()
        eng.close(collective=False)
        took = time.monotonic() - t0
        with open(flag, "w") as f:
            f.write(str(took))
        assert took < 60, f"close of a failed run waited {took:.0f} s for a part that never came"
    else:
        deadline = time.monotonic() + 150  # rank 0's close is bounded; so is this wait
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(flag), "rank 0 never finished its close"
        # Its part comes too late: the commit was abandoned, and the part is not written into
        # a staging directory made anew.
        with pytest.raises(gockpt.CheckpointError, match="abandoned"):
            eng.close(collective=False)
    end_rank()


def test_a_failed_run_does_not_wait_out_the_commit_timeout_for_a_stuck_rank(tmp_path):
    """Rank 0's run fails while a save is in flight and rank 1 never writes its part: rank 0's
    close abandons that commit once the part shows no progress (stock exits at once), leaving
    no checkpoint and no staging."""
    root = str(tmp_path)
    spawn(_abandon_worker, args=(2, _port(), root), nprocs=2)
    assert not gockpt.is_complete(f"{root}/ck")
    assert gockpt.latest_checkpoint(root) is None
    assert [n for n in os.listdir(root) if "gockpt-tmp" in n] == []


def _unstorable_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    m = _model()
    m.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))  # a rotary table
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    config = gockpt.GoCkptConfig(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2)
    eng = ShardedEngine(m, opt, config, commit_timeout_s=30)
    _step(m, opt, 0)
    eng.step_end()
    h = eng.save(f"{root}/ck")
    _step(m, opt, 1)
    eng.step_end()
    want = _full(m, opt)
    with torch.no_grad():
        m.freqs.mul_(2)  # after the captured step: not in the checkpoint
    eng.wait()
    eng.close()
    assert h.captured_step == 2
    # Resumed into a fresh model: the shards' tensors and the table from the part's state tree.
    m2 = _model()
    m2.register_buffer("freqs", torch.zeros(4, dtype=torch.complex64))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    load_sharded(f"{root}/ck", m2, opt2)
    _equal(_full(m2, opt2), want, "loaded")
    # A complex parameter (a DTensor under FSDP2) has no place in a sharded checkpoint yet.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m3 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    m3.rot = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    fully_shard(m3, mesh=init_device_mesh("cpu", (world,)))
    opt3 = torch.optim.AdamW(m3.parameters(), lr=1e-2)
    eng = ShardedEngine(m3, opt3, gockpt.GoCkptConfig(mode="sync"), commit_timeout_s=30)
    with pytest.raises(TypeError, match="'model.rot'.*complex64.*sharded checkpoint"):
        eng.save(f"{root}/refused")
    eng.close()
    # Nor a plain one an optimizer updates (FSDP2 on the linear layers only): the loaders read
    # optimizer state from the shards alone (it was accepted, and the checkpoint never loaded).
    torch.manual_seed(0)
    m4 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    m4.rot = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    for layer in m4:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    opt4 = torch.optim.AdamW(m4.parameters(), lr=1e-2)
    eng = ShardedEngine(m4, opt4, gockpt.GoCkptConfig(mode="sync"), commit_timeout_s=30)
    (m4(torch.randn(8, 16)).pow(2).mean() + m4.rot.abs().pow(2).sum()).backward()
    opt4.step()
    eng.step_end()
    with pytest.raises(TypeError, match="'model.rot'.*complex64.*an optimizer updates"):
        eng.save(f"{root}/refused-param")
    eng.close()
    end_rank()


def test_a_plain_tensor_no_shard_holds_is_kept_in_the_parts_of_a_sharded_checkpoint(tmp_path):
    """A complex buffer in an FSDP2 model (a rotary table, whole on every rank): it was refused
    at the request (every save of such a model failed, where DCP saves it); it is kept in each
    part's state tree now and loaded from there, exactly. A sharded tensor of such a kind (a
    complex parameter), or a plain one an optimizer updates, is still refused with an error
    naming it."""
    spawn(_unstorable_worker, args=(2, _port(), str(tmp_path)), nprocs=2)
    full = load_full(f"{tmp_path}/ck")
    assert full.model_state_dict["freqs"].dtype == torch.complex64
    assert torch.equal(full.model_state_dict["freqs"], torch.polar(torch.ones(4), torch.arange(4.0)))
    assert not os.path.exists(tmp_path / "refused") and not os.path.exists(tmp_path / "refused-param")


def _uneven_model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # 3 output rows per layer: shards of 2 rows and 1, rank 0's share about twice rank 1's.
    m = nn.Sequential(nn.Linear(256, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _uneven_step(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    m(torch.randn(4, 256, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _slots_worker(rank: int, world: int, port: int, root: str) -> None:
    _init(rank, world, port)
    config = gockpt.GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3)
    # A slot's size on each rank (its share, gradient buffers included), from one save.
    m = _uneven_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    eng = ShardedEngine(m, opt, config, commit_timeout_s=30)
    for step in range(3):
        _uneven_step(m, opt, step)
        eng.step_end()
    eng.save(f"{root}/sizing")
    eng.close()
    sizes: list = [None] * world
    dist.all_gather_object(sizes, eng.engine._slots.bytes)  # noqa: SLF001 - the test's sizing
    assert sizes[0] > sizes[1], sizes
    # One host_buffer_bytes for all: rank 0 holds one slot, rank 1 two.
    budget = max(sizes[0], 2 * sizes[1])
    assert budget < 2 * sizes[0], sizes
    m = _uneven_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    eng = ShardedEngine(m, opt, dataclasses.replace(config, host_buffer_bytes=budget, max_inflight=2),
                        commit_timeout_s=30)
    live, handles = {}, []
    for step in range(10):
        _uneven_step(m, opt, step)
        eng.step_end()
        live[eng.version] = _full(m, opt)
        if step in (2, 3):  # the second comes while the first is in its windows
            handles.append(eng.save(f"{root}/ck{step}"))
    eng.wait()  # raised "part rank-00001 holds step 5, not 4" on every rank
    captured = [(h.part.metrics.requested_step, h.part.metrics.num_overlap_steps) for h in handles]
    views: list = [None] * world
    dist.all_gather_object(views, captured)
    assert views[0] == views[1], views  # one step per checkpoint on every rank
    assert captured[0][1] == 2  # the first was finished at the second's request, on both ranks
    eng.close()
    for name, (req, k) in zip(("ck2", "ck3"), captured, strict=True):
        m2 = _uneven_model()
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        load_sharded(f"{root}/{name}", m2, opt2)
        _equal(_full(m2, opt2), live[req + k - 1], name)
    # when_full="skip": rank 0 has no slot for the second save, rank 1 has one. Every rank
    # skips it (every rank raised "the ranks disagree"); the first is committed.
    eng = ShardedEngine(m, opt, dataclasses.replace(config, host_buffer_bytes=budget, max_inflight=2,
                                                    when_full="skip"), commit_timeout_s=30)
    skipped = []
    for step in range(10, 16):
        _uneven_step(m, opt, step)
        eng.step_end()
        if step in (11, 12):
            skipped.append(eng.save(f"{root}/skip{step}").skipped)
    eng.wait()
    assert skipped == [False, True], skipped
    eng.close()

    class Refusing(CheckpointWriter):
        def tensor_files(self, layout):
            if dist.get_rank() == 1:
                raise OSError("refused on rank 1")
            return None

    # A request that fails on rank 1 alone (its writer) while a save is in flight and rank 0
    # is short of a slot: rank 1 finishes that save there too (it kept it to its planned step,
    # and that checkpoint was not committed), and the engines go on.
    eng = ShardedEngine(m, opt, config, commit_timeout_s=30)
    for step in range(16, 22):
        _uneven_step(m, opt, step)
        eng.step_end()
        if step == 16:
            eng.save(f"{root}/inflight")
        if step == 17:
            with pytest.raises((OSError, RuntimeError), match="refused on rank 1"):
                eng.save(f"{root}/refused", writer=Refusing())
        if step == 18:
            eng.save(f"{root}/after")
    eng.wait()
    eng.close()
    end_rank()


def test_ranks_whose_shares_fit_different_numbers_of_host_slots_finish_saves_in_flight_together(tmp_path):
    """One ``host_buffer_bytes`` on ranks of uneven shares: rank 0 has room for one host slot,
    rank 1 for two. A save requested while another is in its copy windows made rank 0 alone
    finish that one at once; its parts then held different steps, it was not committed, and
    ``wait`` raised on every rank. Now every rank finishes it there; with
    ``when_full="skip"`` every rank skips the new one; and a request failing on one rank alone
    still finishes the save in flight on every rank."""
    spawn(_slots_worker, args=(2, _port(), str(tmp_path)), nprocs=2)
    assert load_full(f"{tmp_path}/ck2").captured_step == 4
    assert load_full(f"{tmp_path}/skip11").captured_step > 0
    assert not os.path.exists(f"{tmp_path}/skip12") and not os.path.exists(f"{tmp_path}/refused")
    assert load_full(f"{tmp_path}/inflight").captured_step == 18  # finished at the refused request
    assert gockpt.latest_checkpoint(str(tmp_path)).endswith("after")
