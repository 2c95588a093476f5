"""GoCkpt: checkpointing for PyTorch training that does not stop the training.

The engine copies a checkpoint's blocks across several training steps, copies the gradients of
the blocks already copied, and replays the optimizer on the CPU so every block reaches the same
step (GoCkpt §4), then persists safetensors-layout shards through fsspec with the manifest last
and an atomic publish (PCcheck §4.1).
"""

from __future__ import annotations

from .config import MODES, GoCkptConfig
from .engine import Engine
from .format import CheckpointCorruptError
from .handle import CheckpointMetrics, SaveHandle
from .persist import CheckpointCancelledError
from .restore import LoadedState, load_checkpoint, load_into
from .storage import latest_checkpoint, remove_checkpoint
from .transfer import CheckpointTornError

__all__ = [
    "MODES",
    "CheckpointCancelledError",
    "CheckpointCorruptError",
    "CheckpointMetrics",
    "CheckpointTornError",
    "Engine",
    "GoCkptConfig",
    "LoadedState",
    "SaveHandle",
    "latest_checkpoint",
    "load_checkpoint",
    "load_into",
    "remove_checkpoint",
]
__version__ = "0.1.0"
