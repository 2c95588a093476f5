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
from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import DistributedType

from gockpt import GoCkptConfig
from gockpt import env as _env
from gockpt.layout import shared_parameters
from gockpt.options import engine_options

from .checkpointer import GoCkptCheckpointer

# FSDP version 2 is supported (every process saves its shards: accelerate_gockpt._sharded);
# version 1 is refused in attach().
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


ENV_PREFIX = _env.ENV_PREFIX
CONFIG_FILE_ENV = _env.CONFIG_FILE_ENV


_NOT_OPTIONS = ("storage_options", "update_latest")
"""Engine fields the plugin does not offer: checkpoints go to the local ``project_dir``, and
the engine's ``latest`` pointer is off (the folders are Accelerate's, ordered by number)."""

# Every scalar GoCkptConfig field, as an optional field of the plugin (same name and meaning;
# None: from the environment, the config file, or the engine's default), so none can drift.
_EngineOptions = engine_options(exclude=_NOT_OPTIONS)


@dataclass(kw_only=True)
class GoCkptPlugin(_EngineOptions):  # type: ignore[misc, valid-type]
    """Options of GoCkpt under Accelerate; pass it to :func:`accelerate_gockpt.attach`.

    It takes every scalar option of :class:`gockpt.GoCkptConfig` (``mode``,
    ``max_overlap_steps``, ``host_buffer_bytes`` ...: same names, meanings and units; ``None``
    resolves as the module doc says) and the fields below.

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
    log_metrics: bool | None = field(default=None, metadata={"help": (
        "Send each published checkpoint's metrics (gockpt/stall_s, gockpt/bytes, ...) to the "
        "accelerator's trackers with accelerator.log (default False: the trackers get only "
        "what the script logs, as without GoCkpt).")})
    config_file: str | None = field(default=None, metadata={"help": (
        "YAML or JSON file of defaults for the fields above (env: GOCKPT_CONFIG_FILE).")})

    def __post_init__(self) -> None:
        self.resolve({"enabled": True, "exact_step": False, "publish_timeout_s": 600.0,
                      "log_metrics": False},
                     check=self._check)
        if self.gockpt_dir is not None:
            warnings.warn("GoCkptPlugin(gockpt_dir=...) is ignored: checkpoints are written once, "
                          "in Accelerate's layout, beside the checkpoint", DeprecationWarning, stacklevel=3)

    def _check(self) -> None:
        if self.publish_timeout_s is None or not self.publish_timeout_s > 0:
            raise ValueError(f"publish_timeout_s must be > 0, got {self.publish_timeout_s}")

    def to_config(self) -> GoCkptConfig:
        """The engine configuration these options describe (``latest`` pointer off).

        Raises:
            ValueError: a value out of range, naming the field.
        """
        return self.engine_config(update_latest=False)

    def attach(self, accelerator: Any) -> GoCkptCheckpointer | None:
        """Attach GoCkpt to a prepared ``accelerator``; see :func:`accelerate_gockpt.attach`."""
        return attach(accelerator, self)


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
        NotImplementedError: DeepSpeed, FSDP version 1, Megatron-LM or XLA (their own
            checkpoint formats), several FSDP2 models, ``save_on_each_node`` across several
            machines, or a parameter in more than one optimizer.
        ValueError: nothing prepared, or a wrapper whose state_dict keys do not map onto the
            unwrapped model's.
        RuntimeError: already attached (by an earlier ``attach``; one made automatically at
            ``prepare``, see :mod:`accelerate_gockpt.run`, is replaced).
        TypeError: an optimizer that is not a ``torch.optim.Optimizer``.
    """
    plugin = plugin if plugin is not None else GoCkptPlugin()
    if not plugin.enabled:
        return None
    if accelerator.distributed_type in _UNSUPPORTED:
        raise NotImplementedError(f"GoCkpt does not support {accelerator.distributed_type}")
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise NotImplementedError("GoCkpt supports FSDP version 2 (fsdp_version=2, fully_shard), not version 1")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    if accelerator.project_configuration.save_on_each_node and local != accelerator.num_processes:
        raise NotImplementedError("GoCkpt does not support save_on_each_node across machines")
    if not accelerator._models or not accelerator._optimizers:
        raise ValueError("attach GoCkpt after accelerator.prepare(model, optimizer, ...)")
    if shared_parameters([getattr(o, "optimizer", o) for o in accelerator._optimizers]):
        raise NotImplementedError("GoCkpt needs each parameter in one optimizer; here a parameter is in "
                                  "several (keep Accelerate's save_state: GOCKPT_ENABLED=0)")
    current = getattr(accelerator.save_state, "__self__", None)
    if isinstance(current, GoCkptCheckpointer):
        if not current.automatic:
            raise RuntimeError("GoCkpt is already attached to this accelerator")
        current.close()  # attached at prepare by GOCKPT_ENABLED / the launcher: the script's wins
    return GoCkptCheckpointer(accelerator, plugin)
