"""The non-tensor files of ``Accelerator.save_state``, made by Accelerate's own functions.

Called on the training thread at the captured step (the engine's ``state_fn`` on the main
process, the share of every other process), so RNG, counters, schedulers, sampler and
dataloader state, the scaler and registered objects describe the same step as the tensors.
``accelerate.checkpointing.save_accelerator_state`` and ``save_custom_state`` write them, with
no model and no optimizer, into a temporary directory; their bytes are the snapshot (they are
small), written into the checkpoint by the persist thread. Accelerate's layout and keys are thus
its own, whatever its version adds (device RNGs, XLA seeds, ...).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accelerate.checkpointing import save_accelerator_state, save_custom_state
from accelerate.utils import RNG_STATE_NAME


def rng_file_name(process_index: int) -> str:
    """``random_states_<rank>.pkl``."""
    return f"{RNG_STATE_NAME}_{process_index}.pkl"


def host_files(accelerator: Any, *, rng_only: bool = False) -> dict[str, bytes]:
    """File name -> bytes of what ``save_state`` writes besides model weights and optimizers.

    Args:
        accelerator: the ``Accelerator``.
        rng_only: only this process's ``random_states_<rank>.pkl`` (the other processes' share;
            the main process writes the rest).
    """
    on_each_node = accelerator.project_configuration.save_on_each_node
    with tempfile.TemporaryDirectory(prefix="gockpt-accelerate-") as d:
        save_accelerator_state(d, [], [], [] if rng_only else accelerator._schedulers,
                               [] if rng_only else accelerator._dataloaders, accelerator.process_index,
                               accelerator.step, None if rng_only else accelerator.scaler,
                               save_on_each_node=on_each_node)
        for i, obj in enumerate([] if rng_only else accelerator._custom_objects):
            save_custom_state(obj, d, i, save_on_each_node=on_each_node)
        names = [rng_file_name(accelerator.process_index)] if rng_only else sorted(os.listdir(d))
        return {name: Path(d, name).read_bytes() for name in names}


@dataclass
class AtBoundary:
    """What of the state ``save_state`` writes moves after a step boundary within the same
    optimizer step, taken at the boundary: ``Accelerator.step`` (``accumulate()`` advances it)
    and the RNG states (a forward with dropout draws from them). The dataloader's state moves
    at the fetch, after the boundary's hook; schedulers, the scaler and registered objects
    move with the update. Python, NumPy, CPU and CUDA generators only: another device's (XPU,
    NPU, MPS, XLA) is taken live at the capture."""

    version: int
    step: int
    python: Any
    numpy: Any
    torch: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def take(cls, accelerator: Any, version: int) -> AtBoundary:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(version, accelerator.step, random.getstate(), np.random.get_state(),
                   torch.get_rng_state(), cuda)


@contextlib.contextmanager
def as_of(accelerator: Any, at: AtBoundary | None) -> Iterator[None]:
    """Within the block, ``accelerator.step`` and the RNG states are those of ``at`` (None:
    live); the live ones are put back after it."""
    if at is None:
        yield
        return
    live = AtBoundary.take(accelerator, at.version)
    _put(accelerator, at)
    try:
        yield
    finally:
        _put(accelerator, live)


def _put(accelerator: Any, at: AtBoundary) -> None:
    accelerator.step = at.step
    random.setstate(at.python)
    np.random.set_state(at.numpy)
    torch.set_rng_state(at.torch)
    if at.cuda is not None:
        torch.cuda.set_rng_state_all(at.cuda)
