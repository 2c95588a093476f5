"""Lightning adapter: ``Trainer(plugins=[GoCkptIO()])`` checkpoints without stopping training.

``GoCkptIO`` is the CheckpointIO plugin; ``GoCkptCallback`` is its training-hook half, added to
every Trainer by the ``lightning.pytorch.callbacks_factory`` entry point (inert unless the
Trainer's checkpoint IO is a ``GoCkptIO``). ``load_from_checkpoint(cls, path)`` is
``cls.load_from_checkpoint`` for GoCkpt checkpoint directories (inference).
"""

from __future__ import annotations

import lightning.pytorch  # noqa: F401  - a missing extra fails here, plainly

from .callback import GoCkptCallback
from .inference import load_from_checkpoint
from .io import GoCkptIO

__all__ = ["GoCkptCallback", "GoCkptIO", "load_from_checkpoint"]
