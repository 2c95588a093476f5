"""Lightning adapter: ``Trainer(plugins=[GoCkptIO()])`` checkpoints without stopping training.

``GoCkptIO`` is the CheckpointIO plugin; ``GoCkptCallback`` is its training-hook half, added to
every Trainer by the ``lightning.pytorch.callbacks_factory`` entry point (inert unless the
Trainer's checkpoint IO is a ``GoCkptIO``).
"""

from __future__ import annotations

import lightning.pytorch  # noqa: F401  - a missing extra fails here, plainly

from .callback import GoCkptCallback
from .io import GoCkptIO

__all__ = ["GoCkptCallback", "GoCkptIO"]
