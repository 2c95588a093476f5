"""A tiny Accelerate training loop for the adapter tests, and the subprocess entry points.

In-process, ``test_accelerate.py`` imports :func:`build`, :func:`train` and :func:`snapshot`.
As a script it runs one of:

- ``ddp <project_dir> <mode>`` under ``accelerate launch --multi_gpu --num_processes 2`` on CPU
  (gloo): train with GoCkpt, then resume each rank with plain ``load_state`` and compare; each
  rank writes ``result_<rank>.json`` into ``project_dir``.
- ``crash <project_dir>``: train with ``total_limit=2`` and a save every batch; a save_state
  pre-hook blocks the fourth save (the training thread, inside its staging folder) once the
  third is published and the first rotated out, and prints ``blocked``; the test then
  kills the process with SIGKILL. Each batch prints ``state <batches> <digest>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES = 512
BATCH_SIZE = 4


class Net(nn.Module):
    """Linear layers, BatchNorm (buffers) and dropout (consumes the global RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.norm(self.inp(x)))))


class Progress:
    """The loop's counter, registered for checkpointing (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.batches = sd["batches"]


@dataclass
class Run:
    acc: Accelerator
    model: nn.Module
    opt: Any
    dl: Any
    sched: Any
    progress: Progress


def build(project_dir: str, *, seed: int = 0, accumulation: int = 1, total_limit: int | None = None,
          scaler: bool = False, automatic_naming: bool = True, reset: bool = True) -> Run:
    """A prepared run: AdamW, a per-step LambdaLR, a shuffled loader, a registered counter."""
    if reset:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    acc = Accelerator(
        cpu=True, gradient_accumulation_steps=accumulation,
        project_config=ProjectConfiguration(project_dir=project_dir, total_limit=total_limit,
                                            automatic_checkpoint_naming=automatic_naming))
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(NUM_SAMPLES, 8, generator=g), torch.randn(NUM_SAMPLES, 4, generator=g))
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    dl = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(7))
    if scaler:
        # Accelerate makes no GradScaler on CPU; one set before prepare() is used as on a GPU.
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    torch.manual_seed(100 + seed + acc.process_index)  # dropout masks differ per rank
    return Run(acc, model, opt, dl, sched, progress)


def train(run: Run, total_batches: int, *, on_batch_end=None, inf_at: int | None = None,
          accumulate: bool = True) -> None:
    """Train until ``run.progress.batches == total_batches``, resuming mid-epoch if needed.

    Clips gradients on every real update; ``inf_at`` puts an inf into a gradient at that batch
    (with a GradScaler the update is skipped). ``accumulate=False``: the plain loop without
    ``accelerator.accumulate`` (gradient accumulation off).
    """
    acc = run.acc
    while run.progress.batches < total_batches:
        skip = run.progress.batches % len(run.dl)
        loader = acc.skip_first_batches(run.dl, skip) if skip else run.dl
        for x, y in loader:
            with acc.accumulate(run.model) if accumulate else contextlib.nullcontext():
                loss = F.mse_loss(run.model(x), y)
                acc.backward(loss)
                if inf_at == run.progress.batches:
                    next(run.model.parameters()).grad[0, 0] = float("inf")
                if acc.sync_gradients:
                    acc.clip_grad_norm_(run.model.parameters(), 0.5)
                run.opt.step()
                run.sched.step()
                run.opt.zero_grad()
            run.progress.batches += 1
            if on_batch_end is not None:
                on_batch_end(run)
            if run.progress.batches >= total_batches:
                break


def snapshot(run: Run) -> dict[str, Any]:
    """Deep copies of what a checkpoint must hold, at this batch boundary."""
    inner = run.acc.unwrap_model(run.model)
    return {
        "model": {k: v.clone() for k, v in inner.state_dict().items()},
        "optim": _clone(run.opt.state_dict()),
        "sched": run.sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": run.acc.step,
        "batches": run.progress.batches,
        "scaler": run.acc.scaler.state_dict() if run.acc.scaler is not None else None,
    }


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where two nested state structures differ (bit for bit for tensors)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return [f"{where}: {type(got).__name__} vs tensor {want.dtype}{list(want.shape)}"]
        a, b = got.detach().contiguous().view(-1), want.detach().contiguous().view(-1)
        if a.numel() and not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return [f"{where}: values differ"]
        return []
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys {sorted(map(str, set(got) ^ set(want)))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where}: length"]
        return [d for i, (a, b) in enumerate(zip(got, want, strict=True)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def digest(run: Run) -> str:
    """A hash of the unwrapped model's tensors (for comparing across processes)."""
    h = hashlib.sha256()
    for k, v in run.acc.unwrap_model(run.model).state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- subprocesses


def _ddp(project_dir: str, mode: str) -> None:
    from accelerate_gockpt import GoCkptPlugin, attach

    run = build(project_dir, total_limit=2, reset=False)
    rank = run.acc.process_index
    # A bounded wait for the other process's share: a save that can never publish fails fast.
    ckpt = attach(run.acc, GoCkptPlugin(mode=mode, min_overlap_steps=3, max_overlap_steps=3,
                                        publish_timeout_s=60))
    live: dict[int, dict] = {}

    # BatchNorm statistics are per process under DDP (each forward takes rank 0's); a
    # checkpoint holds the main process's, as Accelerate's does.
    buffers = {k for k, _ in run.acc.unwrap_model(run.model).named_buffers()} if rank else set()

    def on_batch_end(r: Run) -> None:
        live[r.progress.batches] = snapshot(r)
        if r.progress.batches in (2, 5, 8, 10, 12):  # 10, 12: after a load_state (engines restarted)
            r.acc.save_state()
        if r.progress.batches == 12:
            # A load into the whole model at the request's step, on every process (a re-sync):
            # the save just requested is taken before it, on every process.
            inner = r.acc.unwrap_model(r.model)
            inner.load_state_dict({k: v.clone() for k, v in inner.state_dict().items()})
        if r.progress.batches == 8:
            # Loaded at once, the save still pending: every process loads this one (published
            # by the main process), which holds the state it has now; not the one before.
            r.acc.load_state()
            got, want = ({**x, "model": {k: v for k, v in x["model"].items() if k not in buffers}}
                         for x in (snapshot(r), live[8]))
            wrong = differences(got, want, "load_state() after save_state()")
            if wrong:
                raise SystemExit(f"rank {rank}: " + "; ".join(wrong[:5]))
            # Nothing requested since: no collective, as stock's load_state, which a script
            # may call on the main process alone (the same folder: nothing changes).
            if r.acc.is_main_process:
                r.acc.load_state()

    train(run, 14, on_batch_end=on_batch_end)
    final = snapshot(run)
    published = [m.captured_step for m in ckpt.wait()]
    ckpt.close()
    run.acc.wait_for_everyone()  # the main process publishes after the others' files are in
    root = os.path.join(project_dir, "checkpoints")
    names = sorted(os.listdir(root))
    errors: list[str] = []
    resumed = []
    for name in names:
        # Plain Accelerate from here on: GoCkpt is detached.
        fresh = build(project_dir, seed=5, reset=False)
        fresh.acc.load_state(os.path.join(root, name))
        c = fresh.progress.batches
        resumed.append(c)
        got = snapshot(fresh)
        errors += differences(got["rng"], live[c]["rng"], f"{name}:rng")
        model = {k: v for k, v in got["model"].items() if k not in buffers}
        errors += differences(model, {k: live[c]["model"][k] for k in model}, f"{name}:model")
        errors += differences(got["optim"], live[c]["optim"], f"{name}:optim")
        errors += differences(got["sched"], live[c]["sched"], f"{name}:sched")
        train(fresh, 14)
        errors += differences(snapshot(fresh)["model"], final["model"], f"{name}:final")
    result = {"rank": rank, "names": names, "resumed_batches": resumed, "errors": errors,
              "published": published}
    with open(os.path.join(project_dir, f"result_{rank}.json"), "w") as f:
        json.dump(result, f)
    # Not end_training(): tearing a gloo group down races with the peer's exit and can abort
    # ("terminate called without an active exception") after the results are on disk.
    run.acc.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)


def _hooks(project_dir: str) -> None:
    """save_state pre-hooks on every process, as stock runs them; the second save's hook raises
    on process 1 only, and that error ends process 1 as it ends stock's."""
    from accelerate_gockpt import GoCkptPlugin, attach

    run = build(project_dir, reset=False)
    rank = run.acc.process_index
    seen = []

    def hook(models, weights, output_dir):
        seen.append(os.path.basename(output_dir.rstrip("/")))
        with open(os.path.join(project_dir, f"hook_{rank}.json"), "w") as f:
            json.dump(seen, f)
        if rank == 1 and len(seen) == 2:
            raise RuntimeError("the pre-hook failed on process 1")

    run.acc.register_save_state_pre_hook(hook)
    attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    train(run, 2)
    run.acc.save_state()
    train(run, 2)
    run.acc.save_state()
    _say(f"rank {rank} passed the second save")
    run.acc.wait_for_everyone()
    os._exit(0)


def _crash(project_dir: str) -> None:
    from accelerate_gockpt import GoCkptPlugin, attach

    run = build(project_dir, total_limit=2)
    never = threading.Event()

    def block(models: Any, weights: Any, output_dir: str) -> None:  # a save_state pre-hook
        if "checkpoint_3" in output_dir:
            # The hook runs on the training thread; checkpoints 0-2 (captured at their
            # requests: a pre-hook makes saves exact) are published by the writer thread, maybe
            # later on a slow machine. Die only once checkpoint_2 is out and checkpoint_0 is
            # rotated away (not merely "checkpoint_0 absent": it may not be published yet).
            root = os.path.dirname(output_dir)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                    os.path.isdir(os.path.join(root, "checkpoint_2"))
                    and not os.path.exists(os.path.join(root, "checkpoint_0"))):
                time.sleep(0.01)
            _say(f"blocked {output_dir}")
            never.wait()

    run.acc.register_save_state_pre_hook(block)
    # Room for two snapshots: a save a step, each persisted while the next one copies.
    attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2,
                                 host_buffer_bytes=1 << 26))

    def on_batch_end(r: Run) -> None:
        _say(f"state {r.progress.batches} {digest(r)}")
        r.acc.save_state()

    train(run, 10**9, on_batch_end=on_batch_end)


def _say(line: str) -> None:
    """One line to the parent in one write: ``print`` writes its words and the newline one
    call at a time, so the hook's line (GoCkpt's writer thread) and the training loop's could
    interleave ("blockedstate ...") and the parent miss both."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _exit_after_save(project_dir: str, mode: str) -> None:
    # A script whose last call is save_state(): no end_training(), no close().
    from accelerate_gockpt import GoCkptPlugin, attach

    run = build(project_dir)
    attach(run.acc, GoCkptPlugin(mode=mode, min_overlap_steps=2, max_overlap_steps=2))
    train(run, 3)
    run.acc.save_state()
    print(digest(run), flush=True)


def _unchanged_script(project_dir: str) -> None:
    # A plain Accelerate script: no GoCkpt in it (run under accelerate_gockpt.run).
    run = build(project_dir)
    train(run, 3)
    run.acc.save_state()
    attached = type(getattr(run.acc.save_state, "__self__", None)).__name__
    run.acc.end_training()
    print(attached, digest(run), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        _unchanged_script(sys.argv[2])
    elif sys.argv[1] == "exit":
        _exit_after_save(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "ddp":
        _ddp(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "hooks":
        _hooks(sys.argv[2])
    elif sys.argv[1] == "crash":
        _crash(sys.argv[2])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
