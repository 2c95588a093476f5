"""GoCkpt for Hugging Face Accelerate: ``save_state`` that does not stop training.

Two lines in a training script::

    from accelerate_gockpt import attach
    ...
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    attach(accelerator)   # accelerator.save_state / load_state now go through GoCkpt

Options come from :class:`GoCkptPlugin` arguments, ``GOCKPT_*`` environment variables (which
``accelerate launch`` passes to every process) or a file named by ``GOCKPT_CONFIG_FILE``.
Checkpoints land in Accelerate's own layout, so plain ``accelerator.load_state`` resumes.
"""

from __future__ import annotations

import accelerate  # noqa: F401 - a missing extra fails here with a plain ModuleNotFoundError

from .checkpointer import GoCkptCheckpointer
from .plugin import GoCkptPlugin, attach

__all__ = ["GoCkptCheckpointer", "GoCkptPlugin", "attach"]
