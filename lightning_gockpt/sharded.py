"""``GoCkptIO`` under ``ModelParallelStrategy`` (FSDP2) and multi-process DDP: an engine per rank.

``ModelParallelStrategy`` writes its own distributed checkpoints and never calls CheckpointIO,
and DDP calls it on global rank 0 only, so the callback half
(:class:`~lightning_gockpt.GoCkptCallback`) installs the checkpoint hooks on the strategy itself
in ``setup``: the strategy instance becomes an instance of a subclass of its own class
(:func:`install`) whose ``save_checkpoint`` (and, under ``ModelParallelStrategy``,
``load_checkpoint``) go through :class:`gockpt.sharded.ShardedEngine` and
:func:`gockpt.dcp.load_sharded`; everything else is the user's strategy, unchanged. Under DDP
the engine is a replicated one (the ranks share the write; :mod:`lightning_gockpt.replicated`)
and loading stays ``GoCkptIO.load_checkpoint``'s, on every rank.

Call sequence of one checkpoint (every rank, training thread, the same step on all of them):

1. ``ModelCheckpoint`` calls ``Trainer.save_checkpoint``, which dumps Lightning's dict. While
   the engine runs, the strategy's ``lightning_module_state_dict`` / ``optimizer_state`` give
   the live sharded state (``DTensor`` views, no copy, no collective) instead of stock's
   CPU-offloaded copy.
2. ``save_checkpoint`` drops the model and optimizer tensors from the dict (the engine copies
   them from the live shards) and requests the save through the callback's ``request``, as under
   one device: the same copy-window cap, placeholder, removal and logging logic. The request is
   :meth:`gockpt.sharded.ShardedEngine.save`, collective: it returns after the stall.
3. At the captured step every rank's ``state_fn`` runs (Lightning's dict is dumped again there
   when the capture is later than the request, on every rank, as stock runs its hooks on every
   rank); rank 0's part stores it, the other parts store nothing. (Under DDP each part also
   keeps its share of the dict's tensor entries: :func:`lightning_gockpt.replicated.part_state`.)
4. Resuming under ``ModelParallelStrategy`` (``fit(ckpt_path=...)``, every rank; under DDP it
   is ``GoCkptIO.load_checkpoint``'s, :func:`lightning_gockpt.replicated.load`):
   :func:`gockpt.dcp.load_sharded` puts the
   model and optimizer shards in place (any world size); rank 0's non-tensor dict is broadcast
   and returned to Lightning, which restores loops, callbacks, schedulers and precision state.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

import gockpt
from gockpt import GoCkptConfig
from gockpt.partition import Partition
from gockpt.sharded import INDEX_FILE, ShardedEngine, ShardedHandle

from . import replicated
from .replicated import TENSOR_KEYS

if TYPE_CHECKING:
    from .callback import GoCkptCallback

# Lightning strategies whose checkpoints GoCkpt writes as sharded checkpoints.
SHARDED_STRATEGIES = ("ModelParallelStrategy",)
# Strategies that gather the whole state on global rank 0 (``FSDPStrategy`` with
# ``state_dict_type="full"``, its default): rank 0 persists the gathered dict in the background.
GATHERED_STRATEGIES = ("FSDPStrategy",)
# Strategies whose files DeepSpeed writes through its checkpoint-engine seam, which GoCkpt takes
# over: copied to the host at the request, written and committed in the background.
DEEPSPEED_STRATEGIES = ("DeepSpeedStrategy",)
# Replicated strategies whose ranks share the write when there is more than one process.
# (XLAStrategy derives from DDPStrategy but saves through XLA: it keeps rank 0's write.)
REPLICATED_STRATEGIES = ("DDPStrategy",)
_REPLICATED_EXCLUDED = ("XLAStrategy",)


def strategy_kind(strategy: Any) -> str | None:
    """What GoCkpt does with ``strategy``'s checkpoints.

    Returns:
        ``"sharded"`` (every rank saves its shards), ``"replicated"`` (a DDP strategy: the ranks
        share the write when there is more than one), ``"gathered"`` (``FSDPStrategy`` with
        ``state_dict_type="full"``: the strategy gathers the state on global rank 0, which
        persists it), ``"fsdp_sharded"`` (``FSDPStrategy`` with ``state_dict_type="sharded"``:
        stock's DCP directory, written in the background: :mod:`lightning_gockpt.fsdp`),
        ``"deepspeed"`` (every rank's DeepSpeed files written in the background:
        :mod:`lightning_gockpt.deepspeed`), or None (one device: the CheckpointIO path).
    """
    names = [c.__name__ for c in type(strategy).__mro__]
    if any(n in SHARDED_STRATEGIES for n in names):
        return "sharded"
    if any(n in GATHERED_STRATEGIES for n in names):
        # "full" (the default): gathered on rank 0; "sharded": stock's DCP directory, staged.
        return "gathered" if getattr(strategy, "_state_dict_type", None) == "full" else "fsdp_sharded"
    if any(n in DEEPSPEED_STRATEGIES for n in names):  # before DDPStrategy, its base class
        return "deepspeed"
    if any(n in REPLICATED_STRATEGIES for n in names) and not any(n in _REPLICATED_EXCLUDED for n in names):
        return "replicated"
    return None


def shares_write(trainer: Any, storage_options: Any) -> bool:
    """Whether the DDP ranks of ``trainer`` can share the write of its checkpoints.

    Not when an optimizer's state is not replicated (a ZeRO optimizer: Lightning consolidates
    it on rank 0), nor when optimizers share a parameter (their state is taken whole at the
    request, by rank 0), nor when a ``ModelCheckpoint`` saves to a path that is not local (sharded
    checkpoints are local; an object store keeps rank 0's write), nor across several nodes
    (every part must land in one directory that rank 0 sees; node-local disks would leave the
    other nodes' parts where its commit never finds them, so several nodes keep rank 0's write).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gockpt.fsutil import is_local, url_to_fs
    from gockpt.layout import shared_parameters

    if any(hasattr(o, "consolidate_state_dict") for o in trainer.optimizers):
        return False
    if shared_parameters(trainer.optimizers):
        return False
    if getattr(trainer, "num_nodes", 1) > 1:
        return False
    dirs = [cb.dirpath for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]
    return all(is_local(url_to_fs(str(d), storage_options)[0]) for d in dirs)


def install(strategy: Any, callback: GoCkptCallback, kind: str = "sharded") -> None:
    """Route ``strategy``'s checkpoints through ``callback``'s per-rank engine (idempotent).

    The instance's class becomes a subclass of its own class (one per strategy class) whose
    checkpoint methods are :class:`_ShardedCheckpoints`'s (``kind="sharded"``), or only its
    ``save_checkpoint`` (``kind="replicated"``: DDP loads through ``GoCkptIO.load_checkpoint``
    and dumps its live state dicts as stock does), or :class:`_GatheredCheckpoints`'s
    (``kind="gathered"``); a later ``install`` only relinks the callback.
    """
    cls = type(strategy)
    if "_gockpt_base" not in cls.__dict__:
        sub = _SUBCLASSES.get((cls, kind))
        if sub is None:
            names = _REPLICATED_METHODS if kind in ("replicated", "deepspeed", "fsdp_sharded") else None
            source = _GatheredCheckpoints if kind == "gathered" else _ShardedCheckpoints
            methods = {k: v for k, v in vars(source).items()
                       if callable(v) and (names is None or k in names)}
            sub = _SUBCLASSES[(cls, kind)] = type(f"GoCkpt{cls.__name__}", (cls,),
                                                  {**methods, "__module__": __name__, "_gockpt_base": cls})
        strategy.__class__ = sub
    strategy._gockpt_callback = callback


_SUBCLASSES: dict[tuple[type, str], type] = {}
_REPLICATED_METHODS = ("_gockpt_running", "save_checkpoint")


class _ShardedCheckpoints:
    """The checkpoint methods of a ``ModelParallelStrategy`` under ``GoCkptIO``.

    Not a base class: :func:`install` copies these methods into a direct subclass of the
    strategy's class (a mixin base would change the instance layout, and ``__class__`` could
    not be reassigned); ``_gockpt_base`` is that strategy class, whose methods they extend.
    """

    _gockpt_base: Any
    _gockpt_callback: GoCkptCallback | None = None

    def _gockpt_running(self) -> GoCkptCallback | None:
        # DDP whose ranks do not share the write (one process, a ZeRO optimizer) keeps stock's
        # rank-0 path through GoCkptIO.save_checkpoint.
        cb = self._gockpt_callback
        return cb if cb is not None and cb.active and cb.every_rank else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """While the engine runs: the live sharded state dict (no copy); else stock's."""
        if self._gockpt_running() is None:
            return self._gockpt_base.lightning_module_state_dict(self)  # type: ignore[misc]
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """While the engine runs: the live sharded optimizer state dict (no copy); else stock's."""
        if self._gockpt_running() is None:
            return self._gockpt_base.optimizer_state(self, optimizer)  # type: ignore[misc]
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer)  # type: ignore[attr-defined]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """During ``fit``: request a sharded GoCkpt checkpoint at ``filepath``; collective.

        Call on every rank at the same step (``Trainer.save_checkpoint`` does). Returns after
        the stall; the checkpoint is committed in the background, at the latest when ``fit``
        returns. Outside ``fit`` (no engine running), and for the SLURM requeue save
        (``hpc_ckpt_<n>.ckpt``), the strategy's own path is taken (its own format; under DDP
        rank 0's ``GoCkptIO.save_checkpoint``, blocking).

        Raises:
            TypeError: ``storage_options`` given (set them on ``GoCkptIO(storage_options=...)``).
            RuntimeError, OSError: as :meth:`gockpt.sharded.ShardedEngine.save`.
        """
        if storage_options is not None:
            raise TypeError("GoCkptIO takes fsspec options once, as GoCkptIO(storage_options=...), "
                            "not per Trainer.save_checkpoint call")
        from .io import is_hpc_path

        cb = self._gockpt_running()
        if cb is None or is_hpc_path(os.fspath(filepath), cb.trainer):
            # The SLURM requeue save is the strategy's own, blocking (as GoCkptIO's): the job is
            # killed once the signal handler returns, which may have interrupted the engine.
            if cb is not None:
                cb.forget_dump(checkpoint)
                if getattr(self, "_save_distributed_checkpoint", True) is False:
                    # The dump took the live shards (this class's state_dict methods while the
                    # engine runs); stock's full-state save gathers them (collective, as the
                    # dump) and rank 0 writes one file, which the requeued job loads as stock.
                    from lightning.pytorch.plugins.io import TorchCheckpointIO

                    base = self._gockpt_base
                    checkpoint["state_dict"] = base.lightning_module_state_dict(self)
                    if "optimizer_states" in checkpoint:
                        checkpoint["optimizer_states"] = [
                            base.optimizer_state(self, o) for o in self.optimizers]  # type: ignore[attr-defined]
                    if self.is_global_zero:  # type: ignore[attr-defined]
                        TorchCheckpointIO().save_checkpoint(checkpoint, os.fspath(filepath))
                    return
            self._gockpt_base.save_checkpoint(self, checkpoint, filepath)  # type: ignore[misc]
            return
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # type: ignore[attr-defined]
        assert cb.io is not None
        exact = cb.io.exact_step or (cb.io.exact_monitored and cb.is_monitored(path))
        cb.request(checkpoint, path, exact_step=exact)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded GoCkpt checkpoint into the live shards; collective.

        Any world size: ``torch.distributed.checkpoint`` reshards. The model and (when fitting)
        the optimizers are loaded here; the returned dict is Lightning's non-tensor state at
        the captured step (rank 0's). A path that is not a GoCkpt checkpoint is loaded by the
        strategy itself. An incomplete ``last*.ckpt`` resolves, with a warning, to the newest
        complete checkpoint beside it.

        Raises:
            FileNotFoundError: no complete checkpoint at ``checkpoint_path``.
            ValueError: a GoCkpt checkpoint that is not sharded (saved by one device or DDP).
            gockpt.CheckpointCorruptError: a file that does not match its checksum.
        """
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))  # type: ignore[attr-defined]
        io = self.checkpoint_io  # type: ignore[attr-defined]
        if not _is_gockpt(path, io):
            return self._gockpt_base.load_checkpoint(self, path, weights_only=weights_only)  # type: ignore[misc]
        path = io._resolve(path)  # noqa: SLF001 - the same resolution as GoCkptIO.load_checkpoint
        if not os.path.isfile(os.path.join(path, INDEX_FILE)):
            raise ValueError(
                f"{path} is a GoCkpt checkpoint saved without sharding (one device or one DDP "
                "writer); under ModelParallelStrategy GoCkptIO loads sharded GoCkpt checkpoints only")
        allow_pickle = io.allow_pickle or weights_only is False
        verify = io.config.verify_on_load
        module = self.lightning_module  # type: ignore[attr-defined]
        optimizers = list(self.optimizers)  # type: ignore[attr-defined]
        from gockpt.dcp import load_sharded

        # No optimizers (validate / test / predict): the model only. Rank 0's part holds
        # Lightning's dict, whatever the world size: its copy goes to every rank.
        extra = load_sharded(path, module, optimizers, verify=verify, allow_pickle=allow_pickle)
        extra = self.broadcast(extra)  # type: ignore[attr-defined]
        if not isinstance(extra, dict) or not isinstance(extra.get("lightning"), dict):
            raise gockpt.CheckpointCorruptError(f"{path}: a sharded GoCkpt checkpoint not written by GoCkptIO",
                                                path=path)
        # A DDP checkpoint's rank 0 part holds its share of the tensors: loaded above instead.
        return {k: v for k, v in extra["lightning"].items() if k not in TENSOR_KEYS}


class _GatheredCheckpoints:
    """The checkpoint methods of an ``FSDPStrategy`` (``state_dict_type="full"``) under ``GoCkptIO``.

    Saving is stock's up to the write: every rank dumps Lightning's dict, which gathers the
    whole model and optimizer state on global rank 0 (a collective; CPU tensors when there is
    more than one rank), and rank 0 hands it to ``GoCkptIO.save_checkpoint``, whose engine holds
    no live state (:class:`lightning_gockpt.GoCkptCallback`): the gathered tensors are copied
    into the host snapshot at the request (GoCkpt's ``async``) and persisted in the background.
    The stall is the gather and that copy; the write is hidden. Stock raises
    ``IsADirectoryError`` for a path that is a directory; GoCkpt checkpoints are directories, so
    saving over one (``last.ckpt``) replaces it, as a file is replaced under stock (and stock's
    sharded directory at the path, which stock deletes first, is replaced only once the new
    checkpoint is complete).

    Loading a GoCkpt checkpoint reads Lightning's full dict on every rank (as stock reads the
    file on every rank) and loads it as stock loads a full checkpoint: the module through
    FSDP's full state dict, the optimizers through ``FSDP.optim_state_dict_to_load``.
    """

    _gockpt_base: Any
    _gockpt_callback: GoCkptCallback | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Global rank 0 hands the gathered ``checkpoint`` to ``GoCkptIO.save_checkpoint``.

        Raises:
            TypeError: ``storage_options`` given (stock ``FSDPStrategy`` raises it too).
            What ``GoCkptIO.save_checkpoint`` raises.
        """
        io = self.checkpoint_io  # type: ignore[attr-defined]
        if storage_options is not None or not _gockpt_io(io):
            self._gockpt_base.save_checkpoint(self, checkpoint, filepath, storage_options)  # type: ignore[misc]
            return
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # type: ignore[attr-defined]
        if self.is_global_zero:  # type: ignore[attr-defined]
            # A directory at the path (stock's sharded checkpoint, an older GoCkpt one) is
            # replaced by the publish, atomically, once the new checkpoint is complete.
            io.save_checkpoint(checkpoint, path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a GoCkpt checkpoint as stock loads a full checkpoint; other paths as stock.

        Returns:
            Lightning's dict without ``state_dict`` (loaded into the module here).

        Raises:
            FileNotFoundError, gockpt.CheckpointCorruptError, ValueError: as
                ``GoCkptIO.load_checkpoint``.
            RuntimeError: the checkpoint holds another number of optimizers than the run has.
        """
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))  # type: ignore[attr-defined]
        io = self.checkpoint_io  # type: ignore[attr-defined]
        if not _is_gockpt(path, io):
            return self._gockpt_base.load_checkpoint(self, path, weights_only=weights_only)  # type: ignore[misc]
        from lightning.fabric.strategies.fsdp import _get_full_state_dict_context
        from lightning.fabric.strategies.model_parallel import _load_raw_module_state
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        checkpoint = io.load_checkpoint(path, weights_only=weights_only)
        module = self.lightning_module  # type: ignore[attr-defined]
        model = self.model  # type: ignore[attr-defined]
        world_size = self.world_size  # type: ignore[attr-defined]
        _load_raw_module_state(checkpoint.pop("state_dict"), module=model, world_size=world_size,
                               strict=module.strict_loading)
        optimizer_states = checkpoint.get("optimizer_states")
        if optimizer_states is None or module.trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        optimizers = list(self.optimizers)  # type: ignore[attr-defined]
        if len(optimizers) != len(optimizer_states):
            raise RuntimeError(
                f"You have configured {len(optimizers)} optimizers but the checkpoint contains "
                f"{len(optimizer_states)} optimizers to load. Please resume training with the same "
                "number of optimizers or edit the checkpoint manually to remove states.")
        # Every rank loads the whole optimizer state and keeps its own shard of it.
        with _get_full_state_dict_context(model, world_size=world_size, rank0_only=False):
            for optimizer, opt_state in zip(optimizers, optimizer_states, strict=True):
                if opt_state["state"] and isinstance(next(iter(opt_state["state"])), int):
                    opt_state = FSDP.rekey_optim_state_dict(opt_state, OptimStateKeyType.PARAM_NAME, model)
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                    optim_state_dict=opt_state, model=model, optim=optimizer))
        return checkpoint


def _gockpt_io(io: Any) -> bool:
    from .io import GoCkptIO

    return isinstance(io, GoCkptIO)


def _is_gockpt(path: str, io: Any) -> bool:
    """Whether ``path`` is (or, for ``last*.ckpt``, stands for) a GoCkpt checkpoint directory."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from .io import GoCkptIO

    if not isinstance(io, GoCkptIO) or not os.path.isdir(path):
        return False
    return not os.path.isfile(os.path.join(path, _METADATA_FILENAME))  # stock's DCP directory


class ShardedAdapterEngine:
    """The engine interface :class:`~lightning_gockpt.GoCkptCallback` drives, over a ShardedEngine.

    Args:
        model, optimizers, config: as :class:`gockpt.sharded.ShardedEngine`.
        rank: this process's global rank (rank 0's part stores Lightning's dict).
        collective: whether the ranks still meet (False once this rank's run failed: waits and
            closes are then local, never a collective another rank may not reach).
        replicated: DDP: the ranks share the write of the replicated state
            (:mod:`lightning_gockpt.replicated`); else FSDP2 shards.
        synced: DDP: the parameters DDP averages the gradients of (:class:`gockpt.sharded.ShardedEngine`).
        **engine_kwargs: passed to :class:`gockpt.Engine` (``explicit_before_update``, ``start_step``).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[Optimizer], config: GoCkptConfig, *,
                 rank: int, collective: Callable[[], bool], replicated: bool = False,
                 synced: Sequence[Any] | None = None, **engine_kwargs: Any) -> None:
        self.sharded = ShardedEngine(model, list(optimizers), config, replicated=replicated, synced=synced,
                                     **engine_kwargs)
        self.replicated = replicated
        self.config = self.sharded.config
        self.rank = rank
        self._collective = collective
        self._latest: dict[str, ShardedHandle] = {}
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.sharded.version

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers the engine tracks: the callback rebuilds it (on every rank) where the
        loop replaced them."""
        return self.sharded.optimizers

    def abandon_uncaptured(self, reason: str) -> int:
        return self.sharded.abandon_uncaptured(reason)

    def before_update(self) -> None:
        self.sharded.before_update()

    def step_end(self) -> None:
        self.sharded.step_end()

    def flush(self) -> None:
        self.sharded.flush()

    def save(self, path: str, *, state_fn: Callable[[], Any], max_overlap_steps: int | None = None,
             mode: str | None = None, weights_only: bool = False) -> ShardedHandle:
        """:meth:`gockpt.sharded.ShardedEngine.save`; only rank 0's part keeps Lightning's
        non-tensor dict (under DDP each part also keeps its share of the tensor entries).

        ``weights_only`` (DDP): the parts write the model's tensors only, as stock's
        ``save_weights_only`` file holds no optimizer state (still copied, to replay).
        """
        def part_state(part: Partition | None) -> Any:
            tree = state_fn()  # on every rank: Lightning's hooks run where stock runs them
            if self.replicated:
                return replicated.part_state(tree["lightning"], part, self.rank)
            if self.rank != 0:
                return None
            return {"lightning": {k: v for k, v in tree["lightning"].items() if k not in TENSOR_KEYS}}

        store = _model_tensor if weights_only and self.replicated else None
        handle = self.sharded.save(path, part_state_fn=part_state, mode=mode,
                                   max_overlap_steps=max_overlap_steps, store=store)
        with self._lock:
            self._latest[path] = handle
        return handle

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        """Finish every pending save: collective while the ranks meet, else this rank's own."""
        if self._collective():
            return self.sharded.wait(timeout_s)
        return self.sharded.engine.wait(timeout_s)

    def remove(self, path: str) -> None:
        """Delete the sharded checkpoint at ``path`` (rank 0); a save of it in flight first commits.

        A sharded save cannot be cancelled on one rank alone: one in flight is deleted once it
        has ended, unless ``path`` was requested again meanwhile.
        """
        from .staged import remove_when_done

        remove_when_done(path, self._latest, self._lock, self.config)

    def close(self) -> None:
        """Finish the pending saves and stop (collective while the ranks meet)."""
        from .staged import drain_discards

        try:
            self.sharded.close(collective=self._collective())
        finally:
            drain_discards()


def _model_tensor(key: str) -> bool:
    return key.startswith("model.")


def build_engine(callback: GoCkptCallback, trainer: Any, start_step: int | None, *,
                 replicated: bool = False) -> ShardedAdapterEngine:
    """The engine of ``callback`` over ``trainer``'s module and optimizers (every rank; collective).

    ``replicated``: DDP, the ranks share the write; else FSDP2 shards.
    """
    assert callback.io is not None
    return ShardedAdapterEngine(trainer.lightning_module, list(trainer.optimizers), callback.io.config,
                                rank=trainer.global_rank, collective=lambda: not callback._failed,  # noqa: SLF001
                                replicated=replicated, synced=getattr(callback, "_synced", None) if replicated else None,
                                explicit_before_update=True, start_step=start_step)


__all__ = ["DEEPSPEED_STRATEGIES", "GATHERED_STRATEGIES", "REPLICATED_STRATEGIES", "SHARDED_STRATEGIES",
           "ShardedAdapterEngine", "build_engine", "install", "shares_write", "strategy_kind"]
