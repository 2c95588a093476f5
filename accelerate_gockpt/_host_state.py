"""The non-tensor state ``Accelerator.save_state`` writes, taken at one step boundary.

Called on the training thread at the captured step (the engine's ``state_fn`` on the main
process, the rank tracker elsewhere), so RNG, counters, schedulers and registered objects
describe the same step as the tensors. The result is plain picklable data: the engine
serializes it at once, which is the deep copy.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import (
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_sdaa_available,
    is_xpu_available,
)


def rng_states(step: int) -> dict[str, Any]:
    """The content of ``random_states_<rank>.pkl``, keyed as Accelerate's loader expects.

    Args:
        step: ``Accelerator.step`` (micro-batches seen by ``accumulate``).
    """
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if is_xpu_available():
        states["torch_xpu_manual_seed"] = torch.xpu.get_rng_state_all()
    if is_mlu_available():
        states["torch_mlu_manual_seed"] = torch.mlu.get_rng_state_all()  # type: ignore[attr-defined]
    elif is_sdaa_available():
        states["torch_sdaa_manual_seed"] = torch.sdaa.get_rng_state_all()  # type: ignore[attr-defined]
    elif is_musa_available():
        states["torch_musa_manual_seed"] = torch.musa.get_rng_state_all()  # type: ignore[attr-defined]
    if is_hpu_available():
        states["torch_hpu_manual_seed"] = torch.hpu.get_rng_state_all()  # type: ignore[attr-defined]
    if is_neuron_available():
        states["torch_neuron_manual_seed"] = torch.neuron.get_rng_state_all()  # type: ignore[attr-defined]
    if is_cuda_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def main_state(accelerator: Any) -> dict[str, Any]:
    """Everything the main process writes besides model and optimizer tensors.

    Returns:
        ``{"rng", "schedulers", "samplers", "dataloaders", "scaler", "custom"}``: the RNG dict
        of this process, scheduler state_dicts, per dataloader the sampler object Accelerate
        pickles (or None) and the stateful-dataloader state_dict (or None), the GradScaler
        state_dict (or None), and the state_dicts of objects registered for checkpointing.
    """
    samplers, loaders = [], []
    for dl in accelerator._dataloaders:
        sampler = None
        if isinstance(dl.dataset, IterableDatasetShard):
            s = dl.get_sampler()
            sampler = s if isinstance(s, SeedableRandomSampler) else None
        samplers.append(sampler)
        loaders.append(dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None)
    return {
        "rng": rng_states(accelerator.step),
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "samplers": samplers,
        "dataloaders": loaders,
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
    }
