"""accelerate_gockpt under FSDP2 (``fully_shard``): every process saves its shards (issue 13).

Accelerate runs FSDP only on accelerators (``DistributedType.FSDP`` is set for GPU-type
processes), so the scenario runs twice:

- ``cpu``: one process over gloo, the model ``fully_shard``-ed by the script on a CPU mesh and
  prepared by a plain ``Accelerator(cpu=True)``: the adapter sees ``DTensor`` parameters and
  takes the same sharded path as under Accelerate's FSDP2.
- ``cuda`` (marked ``cuda``): ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
  fsdp_version=2))`` on one GPU, Accelerate applying ``fully_shard`` itself.

Each runs in a child process (this file as a script), since it initializes a process group.
The uninterrupted run records its state after every batch; the GoCkpt run saves at batch 4
and 8 (``K`` updates of overlap in ``gockpt_o``); the checkpoint equals the recorded state at
its captured step bit for bit (assembled with :func:`gockpt.dcp.load_full`), and a fresh run
that ``load_state``\\ s it starts equal to the recorded state and ends equal to the
uninterrupted run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
TOTAL = 12
SAVE_AT = (4, 8)
K = {"lazy": 1, "gockpt_o": 3}


def _child(device: str, root: str, mode: str) -> None:  # noqa: PLR0915 - one scenario, top to bottom
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(_HERE))
    import test_accelerate_child as child

    from accelerate_gockpt import GoCkptPlugin, attach
    from gockpt.dcp import load_full

    torch.use_deterministic_algorithms(True)
    if device == "cpu":
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)

    def build(project: str, seed: int = 0) -> child.Run:
        AcceleratorState._reset_state(True)  # noqa: SLF001 - a fresh Accelerator per run, as tests do
        GradientState._reset_state()  # noqa: SLF001
        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        if device == "cpu":
            acc = Accelerator(cpu=True, project_config=config)
        else:
            from accelerate.utils import FullyShardedDataParallelPlugin

            acc = Accelerator(project_config=config, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 4, generator=g))
        torch.manual_seed(seed)
        model = child.Net()
        if device == "cpu":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (1,))
            fully_shard(model.inp, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        dl = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
        # On the GPU Accelerate applies fully_shard here and points the optimizer at the shards.
        model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
        progress = child.Progress()
        acc.register_for_checkpointing(progress)
        torch.manual_seed(100 + seed)
        assert any(isinstance(p, DTensor) for p in acc.unwrap_model(model).parameters())
        return child.Run(acc, model, opt, dl, sched, progress)

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    def snapshot(run: child.Run) -> dict:
        inner = run.acc.unwrap_model(run.model)
        names = {id(p): n for n, p in inner.named_parameters()}
        return {
            "model": {k: full(v) for k, v in inner.state_dict().items()},
            "optim": {f"{names[id(p)]}.{k}": full(v) for p, st in run.opt.optimizer.state.items()
                      for k, v in st.items()},
            "sched": run.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "step": run.acc.step,
            "batches": run.progress.batches,
        }

    ref = build(f"{root}/ref")
    live: dict[int, dict] = {}
    child.train(ref, TOTAL, on_batch_end=lambda r: live.__setitem__(r.progress.batches, snapshot(r)))

    run = build(f"{root}/a")
    ckpt = attach(run.acc, GoCkptPlugin(mode=mode, min_overlap_steps=K[mode], max_overlap_steps=K[mode]))
    child.train(run, SAVE_AT[-1], on_batch_end=lambda r: r.acc.save_state() if r.progress.batches in SAVE_AT
                else None)
    metrics = ckpt.wait()
    ckpt.close()
    assert [m.captured_step for m in metrics] == [b + K[mode] - 1 for b in SAVE_AT[:-1]] + [SAVE_AT[-1]], metrics
    folders = sorted(os.listdir(f"{root}/a/checkpoints"))
    assert folders == ["checkpoint_0", "checkpoint_1"], folders
    first = f"{root}/a/checkpoints/checkpoint_0"
    assert os.path.isfile(f"{first}/sharded.json") and os.path.isdir(f"{first}/rank-00000")
    captured = SAVE_AT[0] + K[mode] - 1
    state = load_full(first)
    want = live[captured]
    assert state.captured_step == captured
    assert child.differences(state.model_state_dict, want["model"], "load_full.model") == []
    got_optim = {f"{p}.{k}": v for p, st in state.optimizer_state.items() for k, v in st.items()}
    assert child.differences(got_optim, want["optim"], "load_full.optim") == []

    fresh = build(f"{root}/b", seed=3)
    again = attach(fresh.acc, GoCkptPlugin(mode="sync"))
    fresh.acc.load_state(first)
    assert fresh.acc.project_configuration.iteration == 1
    got = snapshot(fresh)
    assert got["batches"] == captured
    diffs = []
    for key in ("model", "optim", "sched", "rng", "step"):
        diffs += child.differences(got[key], want[key], f"resumed@{captured}:{key}")
    child.train(fresh, TOTAL)
    diffs += child.differences(snapshot(fresh)["model"], live[TOTAL]["model"], "after resume")
    again.close()
    assert diffs == [], diffs
    dist.destroy_process_group()
    print("fsdp2-ok", flush=True)


def _fail_child(root: str) -> None:
    """One of 2 processes: a fully_shard-ed model over gloo, a multi-step save_state at batch 2,
    then process 1 raises; process 0 goes on into the next step's collectives."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, ProjectConfiguration
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(_HERE))
    import test_accelerate_child as child

    from accelerate_gockpt import GoCkptPlugin, attach

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root,
                                                                     automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = child.Net()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kind = acc.state.distributed_type  # Accelerate runs DDP on CPU: the model stays as sharded
    acc.state.distributed_type = DistributedType.NO
    model = acc.prepare(model)
    acc.state.distributed_type = kind
    opt = acc.prepare(opt)
    attach(acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    g = torch.Generator().manual_seed(dist.get_rank())
    for batch in range(1, 8):
        acc.backward(F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)))
        opt.step()
        opt.zero_grad()
        if batch == 2:
            acc.save_state()
            if dist.get_rank() == 1:
                raise RuntimeError("the user's error on process 1")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(device: str, tmp_path: Path, mode: str) -> None:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if device == "cuda":  # one process of a launcher's world of one
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, __file__, device, str(tmp_path), mode], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "fsdp2-ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("mode", list(K))
def test_fsdp2_shards_are_saved_and_resume_exactly_on_cpu(tmp_path, mode):
    """A fully_shard-ed model under Accelerate: sharded GoCkpt checkpoints equal the live state
    of their captured step, and load_state resumes them bit-identically."""
    _run("cpu", tmp_path, mode)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Accelerate's FSDP needs a CUDA device")
@pytest.mark.parametrize("mode", list(K))
def test_accelerate_fsdp2_on_a_gpu_resumes_exactly(tmp_path, mode):
    """Accelerate's own FSDP2 (fsdp_version=2) on one GPU, as on the CPU above."""
    _run("cuda", tmp_path, mode)


def test_an_error_on_one_process_ends_both_without_waiting_on_each_other(tmp_path):
    """Process 1 raises right after a save_state whose capture is still ahead; process 0 is
    then stuck in the next step's all-gather until process 1 is gone. Neither may wait on
    the other at exit (a collective wait, a commit waiting for a part that never comes): both
    end as the same loop without GoCkpt does, with the user's error on process 1, and no
    checkpoint folder is left incomplete under its name."""
    port = _port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "fail2", str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=150))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a process was still running 150 s after process 1's error")
    assert procs[1].returncode != 0 and "the user's error on process 1" in outs[1][1], outs[1][1][-3000:]
    assert procs[0].returncode != 0  # its peer is gone, as without GoCkpt
    import gockpt

    root = tmp_path / "checkpoints"
    for entry in (os.listdir(root) if root.exists() else []):
        assert entry.startswith(".") or gockpt.is_complete(str(root / entry)), entry


if __name__ == "__main__":
    if sys.argv[1] == "fail2":
        _fail_child(sys.argv[2])
    else:
        _child(sys.argv[1], sys.argv[2], sys.argv[3])
