"""``GoCkptPlugin``: GoCkpt's options in the style of Accelerate's own plugins.

Every field left ``None`` is resolved in ``__post_init__``, in this order: the explicit
argument, the ``GOCKPT_<FIELD>`` environment variable (``accelerate launch`` passes the
environment to every process), the file named by ``config_file`` / ``GOCKPT_CONFIG_FILE``
(YAML or JSON, one mapping of field names), the default. The file is ours, not part of
``accelerate config``: that YAML rejects unknown top-level keys and drops unknown nested ones.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from accelerate.utils import DistributedType

from gockpt import GoCkptConfig
from gockpt import env as _env

from .checkpointer import GoCkptCheckpointer

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                DistributedType.XLA)


ENV_PREFIX = _env.ENV_PREFIX
CONFIG_FILE_ENV = _env.CONFIG_FILE_ENV


@dataclass(kw_only=True)
class GoCkptPlugin:
    """Options of GoCkpt under Accelerate; pass it to :func:`accelerate_gockpt.attach`.

    Example::

        accelerator = Accelerator(project_config=ProjectConfiguration(
            project_dir="run", automatic_checkpoint_naming=True, total_limit=3))
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        GoCkptPlugin(mode="gockpt").attach(accelerator)   # save_state/load_state now use GoCkpt

    Raises:
        ValueError: from ``__post_init__``: a value out of range (naming the field), an
            unparsable environment variable (naming it), an unknown key in the config file.
        FileNotFoundError: the config file does not exist.
    """

    enabled: bool | None = field(default=None, metadata={"help": (
        "Route save_state through GoCkpt (default True). False leaves Accelerate's blocking "
        "save_state in place, so a launch environment can switch GoCkpt off.")})
    mode: str | None = field(default=None, metadata={"help": (
        "Checkpoint mode: one of gockpt.MODES (default 'auto').")})
    max_overlap_steps: int | None = field(default=None, metadata={"help": (
        "Upper bound on K, the optimizer updates one checkpoint's copy may span (default 7).")})
    min_overlap_steps: int | None = field(default=None, metadata={"help": (
        "Lower bound on K in the multi-step modes (default 1).")})
    host_buffer_bytes: int | None = field(default=None, metadata={"help": (
        "Host memory for snapshot slots in bytes (default: room for max_inflight checkpoints).")})
    max_inflight: int | None = field(default=None, metadata={"help": (
        "Checkpoints in flight at once (default 2).")})
    when_full: str | None = field(default=None, metadata={"help": (
        "'wait' or 'skip' when no snapshot slot is free (default 'wait').")})
    num_io_threads: int | None = field(default=None, metadata={"help": (
        "Threads writing the engine's shard files (default 4).")})
    max_shard_bytes: int | None = field(default=None, metadata={"help": (
        "Tensor bytes per engine shard file (default 1 GiB).")})
    chunk_bytes: int | None = field(default=None, metadata={"help": (
        "Copy and write granularity in bytes (default 4 MiB).")})
    replay_backend: str | None = field(default=None, metadata={"help": (
        "CPU replay backend: 'auto', 'torch' or 'native' (default 'auto').")})
    host_link_bytes_per_s: float | None = field(default=None, metadata={"help": (
        "Emulated device-to-host bandwidth in bytes/s, for benchmarks without an accelerator.")})
    exact_step: bool | None = field(default=None, metadata={"help": (
        "Every checkpoint holds exactly the step at which save_state was called (K = 1), for "
        "scripts that take the resume point from the folder name (default False: in the "
        "multi-step modes the state of K-1 updates later, with RNG, schedulers and registered "
        "objects of that same step).")})
    gockpt_dir: str | None = field(default=None, metadata={"help": (
        "Deprecated and ignored (with a warning): checkpoints are written once, in "
        "Accelerate's layout, in a hidden staging folder beside the checkpoint.")})
    publish_timeout_s: float | None = field(default=None, metadata={"help": (
        "Seconds the main process waits for the other processes' files of a checkpoint "
        "(default 600).")})
    config_file: str | None = field(default=None, metadata={"help": (
        "YAML or JSON file of defaults for the fields above (env: GOCKPT_CONFIG_FILE).")})

    def __post_init__(self) -> None:
        if self.config_file is None:
            self.config_file = os.environ.get(CONFIG_FILE_ENV) or None
        kinds = {f.name: _kind(f.name) for f in fields(self) if f.name != "config_file"}
        sources = _env.fill_unset(self, kinds, self.config_file)
        if self.gockpt_dir is not None:
            warnings.warn("GoCkptPlugin(gockpt_dir=...) is ignored: checkpoints are written once, "
                          "in Accelerate's layout, beside the checkpoint", DeprecationWarning, stacklevel=3)
        if self.enabled is None:
            self.enabled = True
        if self.exact_step is None:
            self.exact_step = False
        if self.publish_timeout_s is None:
            self.publish_timeout_s = 600.0
        try:
            if not self.publish_timeout_s > 0:
                raise ValueError(f"publish_timeout_s must be > 0, got {self.publish_timeout_s}")
            self.to_config()  # range checks of the engine's fields, naming the field
        except ValueError as e:
            raise _env.name_source(e, sources) from None

    def to_config(self) -> GoCkptConfig:
        """The engine configuration these options describe.

        The engine's ``latest`` pointer is off: its checkpoints are intermediate copies.

        Raises:
            ValueError: a value out of range, naming the field.
        """
        kwargs = {name: getattr(self, name) for name in _ENGINE_FIELDS if getattr(self, name) is not None}
        return GoCkptConfig(update_latest=False, **kwargs)

    def attach(self, accelerator: Any) -> GoCkptCheckpointer | None:
        """Attach GoCkpt to a prepared ``accelerator``; see :func:`accelerate_gockpt.attach`."""
        return attach(accelerator, self)


_ENGINE_FIELDS = (
    "mode", "max_overlap_steps", "min_overlap_steps", "host_buffer_bytes", "max_inflight",
    "when_full", "num_io_threads", "max_shard_bytes", "chunk_bytes", "replay_backend",
    "host_link_bytes_per_s",
)
_BOOL_FIELDS = ("enabled", "exact_step")
_INT_FIELDS = ("max_overlap_steps", "min_overlap_steps", "host_buffer_bytes", "max_inflight",
               "num_io_threads", "max_shard_bytes", "chunk_bytes")
_FLOAT_FIELDS = ("host_link_bytes_per_s", "publish_timeout_s")


def _kind(name: str) -> type:
    return bool if name in _BOOL_FIELDS else int if name in _INT_FIELDS else \
        float if name in _FLOAT_FIELDS else str


def attach(accelerator: Any, plugin: GoCkptPlugin | None = None) -> GoCkptCheckpointer | None:
    """Route a prepared accelerator's ``save_state``/``load_state`` through GoCkpt.

    Call once on every process, after the last ``accelerator.prepare(...)``::

        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        attach(accelerator)     # options from GOCKPT_* variables or GOCKPT_CONFIG_FILE

    The engine sees ``accelerator.unwrap_model(model)`` and the optimizers inside Accelerate's
    wrappers, whose step hooks count real updates only: steps skipped during gradient
    accumulation or on a GradScaler overflow are never replayed. Accelerate runs no closures, so
    an optimizer's step pre-hook ends each copy window.

    Args:
        accelerator: an ``accelerate.Accelerator`` with at least one prepared model and optimizer.
        plugin: options; ``GoCkptPlugin()`` (environment, then config file) when None.

    Returns:
        The :class:`GoCkptCheckpointer`, or None when the plugin is disabled (Accelerate's own
        methods stay in place).

    Raises:
        NotImplementedError: DeepSpeed, FSDP, Megatron-LM or XLA (their own checkpoint
            formats), or ``save_on_each_node`` across several machines.
        ValueError: nothing prepared, or a wrapper whose state_dict keys do not map onto the
            unwrapped model's.
        RuntimeError: already attached.
        TypeError: an optimizer that is not a ``torch.optim.Optimizer``.
    """
    plugin = plugin if plugin is not None else GoCkptPlugin()
    if not plugin.enabled:
        return None
    if accelerator.distributed_type in _UNSUPPORTED:
        raise NotImplementedError(f"GoCkpt does not support {accelerator.distributed_type}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    if accelerator.project_configuration.save_on_each_node and local != accelerator.num_processes:
        raise NotImplementedError("GoCkpt does not support save_on_each_node across machines")
    if not accelerator._models or not accelerator._optimizers:
        raise ValueError("attach GoCkpt after accelerator.prepare(model, optimizer, ...)")
    if isinstance(getattr(accelerator.save_state, "__self__", None), GoCkptCheckpointer):
        raise RuntimeError("GoCkpt is already attached to this accelerator")
    return GoCkptCheckpointer(accelerator, plugin)
