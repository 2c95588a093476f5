"""Accelerate's folder layout, written once by the engine (a :class:`gockpt.writer.CheckpointWriter`).

Call sequence of one ``save_state`` (main process):

1. (training thread, at the request) the checkpointer makes a staging folder beside the
   checkpoint (``.0-<name>.gockpt-tmp-<pid>-<hex>``: Accelerate orders a folder by the first run
   of digits in each name, so a leftover of a killed process sorts first and plain
   ``load_state()`` never picks it) and asks the engine for the save with an
   :class:`AccelerateWriter`; the other processes learn the folder (broadcast).
2. (engine's io threads) ``model.safetensors`` is written zero-copy from the engine's host
   snapshot, under Accelerate's key names (tied weights once, under their first name).
3. (persist thread) ``optimizer.bin`` from the snapshot, the files Accelerate's own functions
   made at the captured step (scheduler, sampler, dataloader, scaler, RNG, registered objects:
   :mod:`._host_state`), ``gockpt.json`` (``register_save_state_pre_hook`` hooks run first, as
   Accelerate runs them); other processes rename their ``random_states_<rank>.pkl`` in.
4. (persist thread) every rank's file present: the manifest, then the folder is renamed into
   place (PCcheck §4.1: the old checkpoint is never touched before the new one is complete);
   then the numbered checkpoints past ``total_limit`` are deleted (Accelerate deletes before it
   writes), each crash-safely.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from gockpt.layout import StateLayout
from gockpt.ranks import wait_for_shares
from gockpt.snapshot import to_bytes, untie
from gockpt.storage import prune_numbered
from gockpt.writer import CheckpointWriter, Snapshot, TensorFile

from ._host_state import rng_file_name

SIDECAR_NAME = "gockpt.json"
"""Beside Accelerate's files (its loader ignores it): ``iteration`` (the save's
``ProjectConfiguration.iteration``), ``requested_step`` and ``captured_step`` (optimizer updates
the engine counted since ``attach`` or the last ``load_state``), ``mode``, ``num_overlap_steps``."""

SIDECAR_FORMAT = "gockpt-accelerate"
SIDECAR_VERSION = 1

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
                    out[self._weights_name(i)] = safetensors.torch.save(untie(sd), {"format": "pt"})
                else:
                    out[self._weights_name(i)] = to_bytes(sd)
        for i, osd in enumerate(snapshot.optimizer_state_dicts):
            out[f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"] = to_bytes(osd)
        out.update(snapshot.extra)  # Accelerate's own files of the captured step (_host_state)
        m = snapshot.metrics
        out[SIDECAR_NAME] = json.dumps({
            "format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "iteration": self.iteration,
            "requested_step": m.requested_step, "captured_step": m.captured_step, "mode": m.mode,
            "num_overlap_steps": m.num_overlap_steps, "num_processes": self.num_processes,
        }, indent=1).encode()
        return out

    def before_publish(self, snapshot: Snapshot) -> None:
        wait_for_shares(self.staging, [rng_file_name(r) for r in range(1, self.num_processes)],
                        self.timeout_s, self.stopped)

    def after_publish(self, snapshot: Snapshot) -> None:
        if self.rotate_root is not None and self.total_limit is not None:
            prune_numbered(self.rotate_root, self.total_limit)


def read_sidecar(directory: str) -> dict[str, Any] | None:
    """The sidecar of a checkpoint directory, or None if it has none (a plain Accelerate one)."""
    try:
        with open(os.path.join(directory, SIDECAR_NAME), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) and data.get("format") == SIDECAR_FORMAT else None


# ---------------------------------------------------------------------------------------------
