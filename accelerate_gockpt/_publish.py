"""Accelerate's folder layout, written once by the engine (a :class:`gockpt.writer.CheckpointWriter`).

Call sequence of one ``save_state`` (main process):

1. (training thread, at the request) the checkpointer makes a staging folder beside the
   checkpoint (``.0-<name>.gockpt-tmp-<pid>-<hex>``: Accelerate orders a folder by the first run
   of digits in each name, so a leftover of a killed process sorts first and plain
   ``load_state()`` never picks it) and asks the engine for the save with an
   :class:`AccelerateWriter`; the other processes learn the folder (broadcast).
2. (engine's io threads) ``model.safetensors`` is written zero-copy from the engine's host
   snapshot, under Accelerate's key names (tied weights once, under their first name).
3. (persist thread) ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin`` / ``dl_state_dict.bin``,
   ``scaler.pt``, ``random_states_0.pkl``, ``custom_checkpoint_<i>.pkl``, ``gockpt.json`` from the
   snapshot at the captured step (``register_save_state_pre_hook`` hooks run first, as
   Accelerate runs them); other processes rename their ``random_states_<rank>.pkl`` in.
4. (persist thread) every rank's file present: the manifest, then the folder is renamed into
   place (PCcheck §4.1: the old checkpoint is never touched before the new one is complete);
   then the numbered checkpoints past ``total_limit`` are deleted (Accelerate deletes before it
   writes), each crash-safely.
"""

from __future__ import annotations

import io
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
from gockpt.layout import StateLayout
from gockpt.snapshot import own_storage
from gockpt.writer import CheckpointWriter, Snapshot, TensorFile

SIDECAR_NAME = "gockpt.json"
"""Beside Accelerate's files (its loader ignores it): ``iteration`` (the save's
``ProjectConfiguration.iteration``), ``requested_step`` and ``captured_step`` (optimizer updates
the engine counted since ``attach`` or the last ``load_state``), ``mode``, ``num_overlap_steps``."""

SIDECAR_FORMAT = "gockpt-accelerate"
SIDECAR_VERSION = 1

_NUMBER = re.compile(r"([0-9]+)")


@dataclass(kw_only=True)
class AccelerateWriter(CheckpointWriter):
    """Writes one ``save_state`` in Accelerate's layout (see the module doc).

    Attributes:
        staging: the staging folder made at the request (beside the checkpoint).
        key_map: engine model key -> (model index, Accelerate's key).
        num_models: models prepared by the accelerator.
        safe_serialization: weights as safetensors (True) or ``torch.save`` (False).
        iteration: ``ProjectConfiguration.iteration`` of this save.
        num_processes: processes, each contributing ``random_states_<rank>.pkl``.
        rotate_root, total_limit: with automatic naming, where the numbered checkpoints are
            and how many to keep (None: keep all).
        timeout_s: how long to wait for the other processes' files, in seconds.
        pre_hooks: ``register_save_state_pre_hook`` hooks: ``hook(models, weights, output_dir)``.
        models: the accelerator's prepared models (passed to ``pre_hooks``).
        stopped: True => stop waiting for other processes (the checkpointer is closing).
        claim_directory: claim the parent folder (``checkpoints/`` with automatic naming; not
            the folder around an explicit ``output_dir``, which other jobs may share).
    """

    staging: str
    key_map: dict[str, tuple[int, str]]
    num_models: int
    safe_serialization: bool
    iteration: int
    num_processes: int
    rotate_root: str | None
    total_limit: int | None
    timeout_s: float
    pre_hooks: list[Callable[..., Any]]
    models: list[Any]
    stopped: Callable[[], bool]
    claim_directory: bool = True

    def _weights_name(self, i: int) -> str:
        base = SAFE_WEIGHTS_NAME if self.safe_serialization else WEIGHTS_NAME
        return base if i == 0 else base.replace(".", f"_{i}.")

    def tensor_files(self, layout: StateLayout) -> list[TensorFile] | None:
        if not self.safe_serialization or self.pre_hooks:
            # Hooks may edit the weights before they are written: built in files() then.
            return []
        # A tied weight is stored once, under the first of its names in state_dict order, as
        # Accelerate's clean_state_dict_for_safetensors keeps it (safetensors' load re-ties).
        first: dict[str, str] = {}  # stored entry key -> the first model key naming it
        for key in layout.model_keys:
            entry = f"model.{key}"
            first.setdefault(layout.aliases.get(entry, entry), key)
        per_model: list[list[tuple[str, str]]] = [[] for _ in range(self.num_models)]
        for entry, key in first.items():
            index, name = self.key_map[key]
            per_model[index].append((entry, name))
        return [TensorFile(self._weights_name(i), pairs, {"format": "pt"})
                for i, pairs in enumerate(per_model)]

    def files(self, snapshot: Snapshot) -> Mapping[str, bytes]:
        out: dict[str, bytes] = {}
        if not self.safe_serialization or self.pre_hooks:
            weights: list[dict[str, Any]] = [{} for _ in range(self.num_models)]
            for key, value in snapshot.model_state_dict.items():
                index, name = self.key_map[key]
                weights[index][name] = value
            for hook in self.pre_hooks:  # as Accelerator.save_state runs them
                hook(self.models, weights, self.staging)
            for i, sd in enumerate(weights):
                if self.safe_serialization:
                    out[self._weights_name(i)] = safetensors.torch.save(_untie(sd), {"format": "pt"})
                else:
                    out[self._weights_name(i)] = _saved(sd)
        host = snapshot.extra
        for i, osd in enumerate(snapshot.optimizer_state_dicts):
            out[f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"] = _saved(osd)
        for i, ssd in enumerate(host["schedulers"]):
            out[f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"] = _saved(ssd)
        for i, (sampler, dl_state) in enumerate(zip(host["samplers"], host["dataloaders"], strict=True)):
            if sampler is not None:
                out[f"{SAMPLER_NAME}.bin" if i == 0 else f"{SAMPLER_NAME}_{i}.bin"] = _saved(sampler)
            if dl_state is not None:
                out["dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"] = _saved(dl_state)
        if host["scaler"] is not None:
            out[SCALER_NAME] = _saved(host["scaler"])
        for i, obj_state in enumerate(host["custom"]):
            out[f"custom_checkpoint_{i}.pkl"] = _saved(obj_state)
        out[f"{RNG_STATE_NAME}_0.pkl"] = _saved(host["rng"])
        m = snapshot.metrics
        out[SIDECAR_NAME] = json.dumps({
            "format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "iteration": self.iteration,
            "requested_step": m.requested_step, "captured_step": m.captured_step, "mode": m.mode,
            "num_overlap_steps": m.num_overlap_steps, "num_processes": self.num_processes,
        }, indent=1).encode()
        return out

    def before_publish(self, snapshot: Snapshot) -> None:
        # Files of other processes appear through a shared filesystem: nothing to block on.
        staging = self.staging
        assert staging is not None
        missing = [f"{RNG_STATE_NAME}_{r}.pkl" for r in range(1, self.num_processes)]
        deadline = time.monotonic() + self.timeout_s
        while missing:
            missing = [n for n in missing if not os.path.exists(os.path.join(staging, n))]
            if not missing:
                return
            if self.stopped() or time.monotonic() > deadline:
                raise TimeoutError(f"{snapshot.path}: other processes did not write {missing} "
                                   f"within {self.timeout_s:.0f} s")
            time.sleep(0.01)

    def after_publish(self, snapshot: Snapshot) -> None:
        if self.rotate_root is not None and self.total_limit is not None:
            rotate(self.rotate_root, self.total_limit)


def _untie(sd: dict[str, Any]) -> dict[str, Any]:
    # Tied weights are one tensor under several names: keep the first (safetensors refuses
    # shared memory; its load_model re-ties).
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            key = (v.untyped_storage().data_ptr(), int(v.storage_offset()))
            if key in seen:
                continue
            seen.add(key)
        out[k] = v
    return out


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(own_storage(obj), buf)
    return buf.getvalue()


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
        gockpt.remove_checkpoint(os.path.join(root, name))  # renamed aside first: crash-safe
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
