"""Accelerate's folder layout, written once by the engine (a :class:`gockpt.folder.FolderWriter`).

One ``save_state`` goes as :mod:`gockpt.folder` describes (staging folder beside the
checkpoint, named so that Accelerate never picks a leftover; rename into place; ``total_limit``
applied after the publish). The files are Accelerate's own:

- (engine's io threads) ``model.safetensors`` (``model_<i>.safetensors`` for more models),
  zero-copy from the engine's host snapshot under Accelerate's key names, tied weights once.
- (persist thread) ``optimizer.bin`` (``optimizer_<i>.bin``) from the snapshot, its tensors'
  bytes copied outside the GIL (:func:`gockpt.torchfile.torch_file`); the files Accelerate's
  own functions made at the captured step (scheduler, sampler, dataloader, scaler, RNG,
  registered objects: :mod:`._host_state`); ``gockpt.json``. ``register_save_state_pre_hook``
  hooks run first, as Accelerate runs them, and then the weights are built from what they
  left (``pytorch_model.bin`` with ``safe_serialization=False``).
- (other processes) ``random_states_<rank>.pkl``, awaited before the publish.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from gockpt.folder import SIDECAR_NAME, FolderWriter, stored_once
from gockpt.layout import StateLayout
from gockpt.snapshot import untie
from gockpt.torchfile import torch_file
from gockpt.writer import Snapshot, TensorFile

#: Entries of a folder ``accelerator.save_state`` writes (one process or many; FSDP's weights
#: and optimizer folders included): a folder holding only these (and no GoCkpt manifest) is a
#: checkpoint Accelerate wrote itself, which GoCkpt's save of that folder replaces as stock's
#: would write over it (:attr:`gockpt.writer.CheckpointWriter.framework_names`).
ACCELERATE_NAMES = re.compile(
    r"(model|pytorch_model)(_\d+)?\.(safetensors|bin)"
    r"|(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin"
    r"|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl"
    r"|pytorch_model_fsdp(_\d+)?(_rank\d+)?(\.bin)?|optimizer_\d+|" + re.escape(SIDECAR_NAME))

SIDECAR_FORMAT = "gockpt-accelerate"
"""The sidecar's ``format`` (version 1); its own fields: ``iteration`` (the save's
``ProjectConfiguration.iteration``) and ``num_processes``."""


@dataclass(kw_only=True)
class AccelerateWriter(FolderWriter):
    """Writes one ``save_state`` in Accelerate's layout (see the module doc).

    Attributes:
        key_map: engine model key -> (model index, Accelerate's key).
        num_models: models prepared by the accelerator.
        safe_serialization: weights as safetensors (True) or ``torch.save`` (False).
        hooked_weights: None, or the models' state dicts (host tensors) as the
            ``register_save_state_pre_hook`` hooks left them, run at the request on the
            training thread: written instead of the snapshot's weights (a model whose dict a
            hook removed is not written).
    """

    sidecar_format: str = SIDECAR_FORMAT
    key_map: dict[str, tuple[int, str]]
    num_models: int
    safe_serialization: bool
    hooked_weights: list[dict[str, Any]] | None = None
    framework_names: re.Pattern[str] | None = ACCELERATE_NAMES
    #: Weights built whole from the snapshot's state dict (files()) rather than written from the
    #: host slot: torch.save'd, hooked, or holding a tensor no shard holds (a uint16 or complex
    #: buffer, which safetensors' own writer stores). Set by tensor_files.
    weights_from_tree: bool = field(default=False, init=False)

    def _weights_name(self, i: int) -> str:
        base = SAFE_WEIGHTS_NAME if self.safe_serialization else WEIGHTS_NAME
        return base if i == 0 else base.replace(".", f"_{i}.")

    def tensor_files(self, layout: StateLayout) -> list[TensorFile] | None:
        self.weights_from_tree = (not self.safe_serialization or self.hooked_weights is not None
                                  or any(k.startswith("model.") for k in layout.left_out))
        if self.weights_from_tree:
            # Weights as the hooks left them, torch.save'd, or with tensors the slot does not
            # hold: built in files() then.
            return []
        return [TensorFile(self._weights_name(i), pairs, {"format": "pt"})
                for i, pairs in enumerate(stored_once(layout, self.key_map, self.num_models))]

    def files(self, snapshot: Snapshot) -> Mapping[str, Any]:
        out: dict[str, Any] = {}
        if self.weights_from_tree:
            weights = self.hooked_weights
            if weights is None:
                weights = [{} for _ in range(self.num_models)]
                for key, value in snapshot.model_state_dict.items():
                    index, name = self.key_map[key]
                    weights[index][name] = value
            for i, sd in enumerate(weights):
                if self.safe_serialization:
                    out[self._weights_name(i)] = safetensors.torch.save(untie(sd), {"format": "pt"})
                else:
                    out[self._weights_name(i)] = torch_file(sd)
        for i, osd in enumerate(snapshot.optimizer_state_dicts):
            out[f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"] = torch_file(osd)
        out.update(snapshot.extra)  # Accelerate's own files of the captured step (_host_state)
        out[SIDECAR_NAME] = self.sidecar_file(snapshot)
        return out
