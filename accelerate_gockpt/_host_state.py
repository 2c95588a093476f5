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

import os
import tempfile
from pathlib import Path
from typing import Any

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
