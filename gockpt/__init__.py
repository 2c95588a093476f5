"""GoCkpt: checkpointing for PyTorch training that does not stop the training.

The engine copies a checkpoint's blocks across several training steps, copies the gradients of
the blocks already copied, and replays the optimizer on the CPU so every block reaches the same
step (GoCkpt §4), then persists safetensors-layout shards through fsspec with the manifest last
and an atomic publish (PCcheck §4.1).
"""

from __future__ import annotations

from .config import MODES, GoCkptConfig
from .engine import Engine
from .errors import (
    CheckpointCancelledError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    CheckpointTimeoutError,
    CheckpointTornError,
)
from .handle import CheckpointMetrics, SaveHandle
from .restore import LoadedState, load_checkpoint, load_into
from .storage import is_complete, latest_checkpoint, remove_checkpoint

__all__ = [
    "MODES",
    "CheckpointCancelledError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMetrics",
    "CheckpointStorageError",
    "CheckpointTimeoutError",
    "CheckpointTornError",
    "Engine",
    "GoCkptConfig",
    "LoadedState",
    "SaveHandle",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "load_into",
    "remove_checkpoint",
]
__version__ = "0.1.0"
