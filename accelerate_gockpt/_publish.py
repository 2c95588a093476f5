"""Rewrite a durable engine checkpoint in Accelerate's layout and publish it atomically.

Call sequence of one checkpoint (all on the main process's publisher thread, never on the
training thread):

1. the engine's checkpoint is durable; load it (local shards are memory-mapped).
2. write ``model.safetensors`` (or ``pytorch_model.bin``), ``optimizer.bin``,
   ``scheduler.bin``, ``sampler.bin`` / ``dl_state_dict.bin``, ``scaler.pt``,
   ``random_states_0.pkl``, ``custom_checkpoint_<i>.pkl`` and the sidecar ``gockpt.json`` into
   a staging folder on the checkpoint's filesystem, each file fsynced.
3. wait until every other process has renamed its ``random_states_<rank>.pkl`` into the folder.
4. fsync the folder and rename it to the checkpoint path (PCcheck §4.1: the old checkpoint is
   never touched before the new one is complete), then delete the checkpoints past
   ``total_limit`` (Accelerate deletes before it writes) and the engine's copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from accelerate.utils import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_NAME,
)

import gockpt
from gockpt.storage import fsync_path

SIDECAR_NAME = "gockpt.json"
"""Beside Accelerate's files (its loader ignores it): ``iteration`` (the save's
``ProjectConfiguration.iteration``), ``requested_step`` and ``captured_step`` (optimizer updates
the engine counted since ``attach`` or the last ``load_state``), ``mode``, ``num_overlap_steps``."""

SIDECAR_FORMAT = "gockpt-accelerate"
SIDECAR_VERSION = 1

_NUMBER = re.compile(r"([0-9]+)")


@dataclass
class PublishJob:
    """One ``save_state`` on the main process.

    Attributes:
        final: the checkpoint directory.
        staging: a fresh directory on the same filesystem, renamed to ``final`` when complete.
        gockpt_path: the engine's checkpoint (local path or fsspec URL).
        iteration: ``ProjectConfiguration.iteration`` this save used.
        safe_serialization: safetensors (True) or ``torch.save`` (False) for the weights.
        key_map: engine model key -> (model index, key in Accelerate's state_dict).
        num_models: models prepared by the accelerator.
        num_processes: processes, each contributing ``random_states_<rank>.pkl``.
        rotate_root / total_limit: with automatic naming, where the numbered checkpoints are
            and how many to keep (None: keep all).
        timeout_s: how long to wait for the other processes' files.
        pre_hooks: ``register_save_state_pre_hook`` hooks, called as Accelerate calls them:
            ``hook(models, weights, output_dir)`` with the staging folder as ``output_dir``.
        models: the accelerator's prepared models, passed to ``pre_hooks``.
    """

    final: str
    staging: str
    gockpt_path: str
    iteration: int
    safe_serialization: bool
    key_map: dict[str, tuple[int, str]]
    num_models: int
    num_processes: int
    rotate_root: str | None
    total_limit: int | None
    timeout_s: float
    pre_hooks: list[Callable[..., Any]] = field(default_factory=list)
    models: list[Any] = field(default_factory=list)


def publish(job: PublishJob, metrics: gockpt.CheckpointMetrics, stopped: Callable[[], bool]) -> None:
    """Write ``job`` in Accelerate's layout and rename it into place (see the module doc).

    Args:
        job: what to publish; its engine checkpoint is durable.
        metrics: the engine's metrics of that checkpoint.
        stopped: True => give up waiting for other processes (closing after a failure).

    Raises:
        TimeoutError: another process's file did not appear within ``job.timeout_s``.
        OSError: from the filesystem. On any error nothing is published; the staging folder
            and the engine's copy are removed either way.
    """
    try:
        state = gockpt.load_checkpoint(job.gockpt_path, allow_pickle=True)
        _write_files(job, state, metrics)
        del state
        _wait_for_ranks(job, stopped)
        fsync_path(job.staging)
        _rename_into_place(job)
        if job.rotate_root is not None and job.total_limit is not None:
            rotate(job.rotate_root, job.total_limit)
    finally:
        discard(job)


def discard(job: PublishJob) -> None:
    """Remove the staging folder and the engine's copy of ``job`` (missing ones are fine)."""
    shutil.rmtree(job.staging, ignore_errors=True)
    gockpt.remove_checkpoint(job.gockpt_path)


def write_rank_file(staging: str, rank: int, states: dict[str, Any]) -> bool:
    """Write ``random_states_<rank>.pkl`` into ``staging`` atomically (temp file, fsync, rename).

    Returns:
        False when ``staging`` is gone (the main process abandoned this checkpoint).
    """
    if not os.path.isdir(staging):
        return False
    name = f"{RNG_STATE_NAME}_{rank}.pkl"
    tmp = os.path.join(staging, f".{name}.tmp-{uuid.uuid4().hex}")
    try:
        _save(states, tmp)
        os.rename(tmp, os.path.join(staging, name))
    except FileNotFoundError:
        return False
    return True


def checkpoint_number(name: str) -> int | None:
    """The number Accelerate orders automatically named checkpoints by (first digits run)."""
    m = _NUMBER.search(name)
    return int(m.group(1)) if m else None


def numbered(root: str) -> list[str]:
    """The numbered entries of ``root`` (missing: none), oldest first, as Accelerate orders them."""
    if not os.path.isdir(root):
        return []
    pairs = [(number, name) for name in os.listdir(root)
             if not name.startswith(".") and (number := checkpoint_number(name)) is not None]
    return [name for _, name in sorted(pairs)]


def rotate(root: str, total_limit: int) -> list[str]:
    """Delete the oldest numbered checkpoints in ``root`` beyond ``total_limit``.

    Returns:
        The names deleted.
    """
    names = numbered(root)
    doomed = names[: max(0, len(names) - total_limit)]
    for name in doomed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return doomed


def read_sidecar(directory: str) -> dict[str, Any] | None:
    """The sidecar of a checkpoint directory, or None if it has none (a plain Accelerate one)."""
    try:
        with open(os.path.join(directory, SIDECAR_NAME), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) and data.get("format") == SIDECAR_FORMAT else None


# ---------------------------------------------------------------------------------------------


def _write_files(job: PublishJob, state: gockpt.LoadedState, metrics: gockpt.CheckpointMetrics) -> None:
    host = state.extra
    d = job.staging
    models: list[dict[str, Any]] = [{} for _ in range(job.num_models)]
    for key, value in state.model_state_dict.items():
        index, name = job.key_map[key]
        models[index][name] = value
    for hook in job.pre_hooks:  # as Accelerator.save_state does, before the weights are written
        hook(job.models, models, d)
    for i, sd in enumerate(models):
        base = SAFE_WEIGHTS_NAME if job.safe_serialization else WEIGHTS_NAME
        name = base if i == 0 else base.replace(".", f"_{i}.")
        sd = _untie(sd)
        if job.safe_serialization:
            path = os.path.join(d, name)
            safetensors.torch.save_file(sd, path, metadata={"format": "pt"})
            fsync_path(path)
        else:
            _save(_owned(sd), os.path.join(d, name))
    for i, osd in enumerate(state.optimizer_state_dicts):
        name = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
        _save(_owned(osd), os.path.join(d, name))
    for i, ssd in enumerate(host["schedulers"]):
        _save(ssd, os.path.join(d, f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"))
    for i, (sampler, dl_state) in enumerate(zip(host["samplers"], host["dataloaders"], strict=True)):
        if sampler is not None:
            _save(sampler, os.path.join(d, f"{SAMPLER_NAME}.bin" if i == 0 else f"{SAMPLER_NAME}_{i}.bin"))
        if dl_state is not None:
            _save(dl_state, os.path.join(d, "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"))
    if host["scaler"] is not None:
        _save(host["scaler"], os.path.join(d, SCALER_NAME))
    for i, obj_state in enumerate(host["custom"]):
        _save(obj_state, os.path.join(d, f"custom_checkpoint_{i}.pkl"))
    _save(host["rng"], os.path.join(d, f"{RNG_STATE_NAME}_0.pkl"))
    sidecar = {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "iteration": job.iteration,
        "requested_step": metrics.requested_step,
        "captured_step": metrics.captured_step,
        "mode": metrics.mode,
        "num_overlap_steps": metrics.num_overlap_steps,
        "num_processes": job.num_processes,
    }
    path = os.path.join(d, SIDECAR_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(sidecar, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _untie(sd: dict[str, Any]) -> dict[str, Any]:
    # Tied weights come back as one tensor object under several keys; keep the first key, as
    # Accelerate's clean_state_dict_for_safetensors does (safetensors' load_model re-ties).
    # Distinct tensors may share the memory map of one shard: that is not tying.
    seen: set[int] = set()
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            if id(v) in seen:
                continue
            seen.add(id(v))
        out[k] = v
    return out


def _owned(obj: Any) -> Any:
    # torch.save writes a tensor's whole storage; a view into a memory-mapped shard would drag
    # the shard along, so such tensors get storage of their own.
    if isinstance(obj, torch.Tensor):
        whole = obj.untyped_storage().nbytes()
        return obj.clone() if whole != obj.numel() * obj.element_size() else obj
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_owned(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_owned(v) for v in obj)
    return obj


def _save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _wait_for_ranks(job: PublishJob, stopped: Callable[[], bool]) -> None:
    missing = [f"{RNG_STATE_NAME}_{r}.pkl" for r in range(1, job.num_processes)]
    deadline = time.monotonic() + job.timeout_s
    while missing:
        missing = [n for n in missing if not os.path.exists(os.path.join(job.staging, n))]
        if not missing:
            return
        if stopped() or time.monotonic() > deadline:
            raise TimeoutError(f"{job.final}: other processes did not write {missing} "
                               f"within {job.timeout_s:.0f} s")
        # Files of other processes appear through a shared filesystem: there is nothing to
        # block on, so poll.
        time.sleep(0.01)


def _rename_into_place(job: PublishJob) -> None:
    parent = os.path.dirname(job.final) or "."
    os.makedirs(parent, exist_ok=True)
    if os.path.lexists(job.final):
        # save_state to an existing folder replaces it; the old one is moved into the staging
        # area first, so a crash in between leaves the complete new one in staging, not a mix.
        aside = os.path.join(os.path.dirname(job.staging),
                             f".{os.path.basename(job.final)}.gockpt-tmp-{os.getpid()}-{uuid.uuid4().hex}")
        os.rename(job.final, aside)
        os.rename(job.staging, job.final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(job.staging, job.final)
    fsync_path(parent)
