"""``GoCkptIO``: Lightning's CheckpointIO backed by the GoCkpt engine.

Call sequence of one checkpoint under ``Trainer(plugins=[GoCkptIO()])`` (global rank 0):

1. (training thread, ModelCheckpoint hook) ``Trainer.save_checkpoint`` dumps Lightning's dict and
   calls :meth:`GoCkptIO.save_checkpoint`; the callback half requests ``engine.save`` with the
   dict as the state tree: its tensors that are the live parameters and optimizer state are not
   copied here, any other tensor (a hook's edit, e.g. averaged weights) is.
2. (training thread, the callback's hooks) ``on_before_optimizer_step`` ends each copy window,
   ``on_train_batch_end`` marks each step boundary (GoCkpt §4.2).
3. (training thread, the captured step) the dict is taken: the request's when the checkpoint holds
   the requested step, else Lightning's dict dumped again at the captured step (its
   ``on_save_checkpoint`` hooks run again there, so their edits match the tensors).
4. (engine threads) replay, shards, manifest, publish; then the metrics reach the loggers at the
   next batch end.

Outside ``fit`` (``trainer.save_checkpoint`` before or after it) the save is blocking
(:func:`gockpt.snapshot.save_tree`).
"""

from __future__ import annotations

import errno
import os
import re
import uuid
import warnings
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

import gockpt
from gockpt import GoCkptConfig
from gockpt.sharded import INDEX_FILE
from gockpt.snapshot import map_tree, save_tree
from gockpt.storage import has_manifest, is_complete, is_local, url_to_fs

from . import _registry

if TYPE_CHECKING:
    from .callback import GoCkptCallback


class GoCkptIO(CheckpointIO):
    """Saves Lightning checkpoints as GoCkpt checkpoint directories without stopping training.

    A checkpoint path (``epoch=0-step=16.ckpt``, ``last.ckpt``) names a directory of shards and a
    manifest. In the multi-step modes a checkpoint may hold a step up to ``K - 1`` optimizer steps
    after the one requested (GoCkpt §4.2); its ``global_step``, loop progress, scheduler, callback
    and precision state are then taken at that same step, so resuming from it continues exactly.
    Checkpoints ranked by a metric (``ModelCheckpoint(monitor=...)``) hold exactly the requested
    step when ``exact_monitored`` is set, because the metric was measured there. Taking
    Lightning's dict again runs the ``on_save_checkpoint`` hooks again, at the captured step.

    With ``ModelCheckpoint``: a save of a path that already holds a checkpoint (``last.ckpt``,
    also while an earlier save of it is in flight) replaces it atomically, and a symlink there is
    replaced, never written through. A local path is created as an empty placeholder directory at
    request time, so ``save_last="link"`` can link to a checkpoint still in flight and
    ``ckpt_path="last"`` finds the link; the placeholder has no manifest, so it is never loaded
    as a checkpoint. Removing a checkpoint, in flight or complete, waits until a newer checkpoint
    of its folder is durable (a save in flight is then cancelled and leaves no file), so a crash
    always leaves a complete checkpoint there; one that nothing newer in its folder follows is
    removed once the run has ended. At the start of training, placeholders and scratch files of a
    run that died are cleared. ``fit`` returns once every requested checkpoint is durable.

    With ``log_metrics=True``, per checkpoint the loggers get ``gockpt/stall_s``,
    ``gockpt/bytes``, ``gockpt/gbps``, ``gockpt/time_to_durable_s``, ``gockpt/num_overlap_steps``
    (K), ``gockpt/requested_step``, ``gockpt/captured_step``, ``gockpt/mode`` (an index into
    :data:`gockpt.MODES`), ``gockpt/unchanged_bytes``, ``gockpt/linked_bytes`` and
    ``gockpt/device_wait_s`` (:meth:`gockpt.CheckpointMetrics.log_dict`), once,
    at the first step Lightning logs at (``log_every_n_steps``) after it became durable, or at
    the end of the run. They go to the loggers directly, as ``LearningRateMonitor``'s do, so
    ``trainer.callback_metrics`` holds only the run's own metrics.

    The ``latest`` pointer of the engine is off by default here (``update_latest=False``):
    ModelCheckpoint's folder holds only checkpoints, and Lightning has ``last.ckpt``. A
    :class:`gockpt.GoCkptConfig` passed as ``config`` is used as it is, and its own default is
    ``update_latest=True`` (a ``latest`` file beside the checkpoints): give it
    ``update_latest=False`` for the same folder as with keyword options.

    Strategies: one device; DDP with more than one process: the ranks share the write, each
    storing a distinct share of the parameters and optimizer state, committed together as one
    checkpoint (:mod:`lightning_gockpt.replicated`; it loads here with any number of processes,
    one device included; with a ZeRO optimizer or checkpoints on an object store global rank 0
    writes, as for one device); ``ModelParallelStrategy`` (FSDP2): every rank saves its shards,
    committed together as one sharded checkpoint (:mod:`lightning_gockpt.sharded`; resume with
    ``fit(ckpt_path=...)`` with any number of ranks). ``FSDPStrategy`` with ``state_dict_type="full"``
    (its default): global rank 0 persists the gathered dict in the background; with
    ``"sharded"``: stock's DCP directory, written with ``async_save`` and committed whole
    (:mod:`lightning_gockpt.fsdp`); ``DeepSpeedStrategy``: DeepSpeed's own files, copied to the
    host at the request and written in the background (:mod:`lightning_gockpt.deepspeed`). The
    last two are loaded by the strategy itself, as its own.

    The callback half (:class:`~lightning_gockpt.GoCkptCallback`) is added to every Trainer by the
    ``lightning.pytorch.callbacks_factory`` entry point and links itself to this plugin in
    ``setup``; passing it in ``callbacks`` works too.

    Loading: the non-tensor state loads with ``torch.load(weights_only=True)``, like Lightning's
    default; checkpoints whose hyperparameters or callback state hold other objects need
    ``allow_pickle=True`` here or ``fit(..., weights_only=False)`` (trusted files only).

    Args:
        config: engine options; or give them as keyword arguments (``mode``,
            ``max_overlap_steps``, ``host_buffer_bytes``, ``max_inflight``, ``num_io_threads``,
            ``storage_options``, ... see :class:`gockpt.GoCkptConfig`).
        exact_monitored: checkpoints of a ModelCheckpoint with ``monitor`` hold exactly the
            requested step (copied over one step, "lazy"); others may be delivered later.
        exact_step: every checkpoint holds exactly the requested step (K = 1).
        allow_pickle: unpickle arbitrary objects in the non-tensor state when loading.
        log_metrics: send each checkpoint's metrics to ``trainer.loggers`` (off by default: the
            loggers get only the run's own metrics, as with stock checkpointing).

    Raises:
        TypeError: both ``config`` and keyword options were given.
        ValueError: an invalid engine option (from :class:`gockpt.GoCkptConfig`).
    """

    def __init__(
        self,
        config: GoCkptConfig | None = None,
        *,
        exact_monitored: bool = True,
        exact_step: bool = False,
        allow_pickle: bool = False,
        log_metrics: bool = False,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise TypeError("pass either a GoCkptConfig or keyword options, not both")
        options.setdefault("update_latest", False)
        self.config = config if config is not None else GoCkptConfig(**options)
        self.exact_monitored = exact_monitored
        self.exact_step = exact_step
        self.allow_pickle = allow_pickle
        self.log_metrics = log_metrics
        self._callback: GoCkptCallback | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Request a checkpoint of the live model and optimizers at ``path`` (a directory).

        During ``fit`` it returns after the request's stall; the checkpoint becomes durable in the
        background and at the latest when ``fit`` returns. Outside ``fit`` (no engine running:
        ``trainer.save_checkpoint`` before or after it), and for the checkpoint Lightning's SLURM
        handler saves on its requeue signal (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``), it
        writes the dict and returns once it is durable.

        Raises:
            TypeError: ``storage_options`` given (set them on ``GoCkptIO(storage_options=...)``).
            gockpt.CheckpointError, OSError: a background error of an earlier checkpoint, or
                (outside ``fit``) this save's storage error.
        """
        if storage_options is not None:
            raise TypeError(
                "GoCkptIO takes fsspec options once, as GoCkptIO(storage_options=...), "
                "not per Trainer.save_checkpoint call")
        path = os.fspath(path)
        cb = self._callback
        hpc = cb is not None and is_hpc_path(path, cb.trainer)
        if cb is None or not cb.active or hpc:
            # Blocking. An hpc save too: Lightning's SLURM handler saves, then the job is
            # requeued and killed; and as a signal handler it may interrupt the engine mid-call,
            # so it stays out of it.
            if cb is not None:
                cb.forget_dump(checkpoint)
            cfg = self.config
            # Lightning resumes an hpc save by its name. The pointer's lock may be held by the
            # very thread the signal interrupted (a rotation's remove_checkpoint): not taken.
            save_tree(path, {"lightning": checkpoint}, step=int(checkpoint.get("global_step", 0)),
                      storage_options=cfg.storage_options, max_shard_bytes=cfg.max_shard_bytes,
                      num_io_threads=cfg.num_io_threads, update_latest=cfg.update_latest and not hpc)
            return
        exact = self.exact_step or (self.exact_monitored and cb.is_monitored(path))
        cb.request(checkpoint, path, exact_step=exact)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint into Lightning's dict (CPU tensors unless ``map_location`` says).

        A ``last*.ckpt`` path that is not complete (a save of it, or of the checkpoint it links
        to, was cut short: no manifest) resolves, with a warning, to the newest complete
        checkpoint in its directory (the ``latest`` pointer); one with a manifest but damaged
        files is loaded, and refused naming the file. A save of ``path`` still in flight in this
        process is finished first (Lightning's tuner restores the checkpoint it just saved; an
        evaluation Trainer with a GoCkptIO of its own loads one that a fit has in flight). A plain file
        is loaded with ``torch.load``. A checkpoint whose DDP ranks shared the write is read from
        all its parts, in any number of processes (:func:`lightning_gockpt.replicated.load`):
        the same dict as a single writer's.

        Args:
            path: checkpoint directory (local path or fsspec URL).
            map_location: a device or device string for the tensors; other forms leave them on
                the CPU, where Lightning copies them to the model's device.
            weights_only: ``False`` allows arbitrary objects in the non-tensor state.

        Returns:
            Lightning's checkpoint dict: its non-tensor entries plus ``state_dict`` and, unless
            saved weights-only, ``optimizer_states``.

        Raises:
            FileNotFoundError: no complete checkpoint at ``path`` (nor, for ``last*.ckpt``,
                in its directory).
            gockpt.CheckpointError: the save of ``path`` in flight in this run failed (its
                error).
            gockpt.CheckpointCorruptError: a corrupt, truncated or hostile file (a symlink, a
                FIFO; names the file and key), or a GoCkpt checkpoint not written by GoCkptIO.
            ValueError: a sharded checkpoint of ``ModelParallelStrategy`` (resume it under that
                strategy; :func:`gockpt.dcp.load_full` assembles it).
        """
        path = os.fspath(path)
        if self._callback is not None and self._callback.io is self:
            self._callback.wait_for(path)  # saved just before in this run: read it whole
        for cb in _registry.live_callbacks():  # or by another Trainer of this process (a fit's, for an evaluation)
            if cb is not self._callback:
                cb.wait_for(path, own=False)
        if os.path.isfile(path):
            return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
        fs, local = url_to_fs(path, self.config.storage_options)
        if not fs.exists(local):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        path = self._resolve(path)
        allow_pickle = self.allow_pickle or weights_only is False
        resolved = url_to_fs(path, self.config.storage_options)[1]
        if is_local(fs) and os.path.isfile(os.path.join(resolved, INDEX_FILE)):  # one part per rank
            from .replicated import load as load_shares

            return _to(load_shares(resolved, verify=self.config.verify_on_load, allow_pickle=allow_pickle),
                       map_location)
        state = gockpt.load_checkpoint(
            path, storage_options=self.config.storage_options,
            verify=self.config.verify_on_load, allow_pickle=allow_pickle)
        extra = state.extra
        if not isinstance(extra, dict) or "lightning" not in extra:
            raise gockpt.CheckpointCorruptError(f"{path}: a GoCkpt checkpoint not written by GoCkptIO")
        checkpoint = dict(extra["lightning"])
        if "state_dict" in checkpoint:  # the whole dict, as Lightning and its hooks wrote it
            return _to(checkpoint, map_location)
        # Written by 0.1.0: the tensors of the live model and optimizers were stored apart.
        checkpoint["state_dict"] = _to(state.model_state_dict, map_location)
        if extra.get("optimizer_states"):
            checkpoint["optimizer_states"] = [_to(sd, map_location) for sd in state.optimizer_state_dicts]
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path``, cancelling its save first if it is in flight.

        No file of a cancelled save is left behind (Lightning issue #14035). A complete checkpoint
        is deleted once the saves requested before are durable, so one complete checkpoint always
        remains. A symlink is unlinked, its target kept.
        """
        path = os.fspath(path)
        if self._callback is not None and self._callback.io is self:
            self._callback.remove(path)
        else:
            gockpt.remove_checkpoint(path, self.config.storage_options)

    def teardown(self) -> None:
        """Backstop at the end of a run: finish pending checkpoints and stop the engine."""
        if self._callback is not None:
            self._callback.close()

    def _last_names(self) -> set[str]:
        """The names Lightning's ``ckpt_path="last"`` looks for: each ModelCheckpoint's
        ``CHECKPOINT_NAME_LAST`` (an instance may set its own), and the default."""
        trainer = self._callback.trainer if self._callback is not None else None
        return {ModelCheckpoint.CHECKPOINT_NAME_LAST} | {
            cb.CHECKPOINT_NAME_LAST for cb in getattr(trainer, "checkpoint_callbacks", ())
            if isinstance(cb, ModelCheckpoint)}

    def _resolve(self, path: str) -> str:
        options, timeout_s = self.config.storage_options, self.config.storage_timeout_s
        if is_complete(path, options, timeout_s):
            return path
        if has_manifest(path, options, timeout_s):
            # Damaged, not incomplete (the manifest is written last): the load names the file
            # at fault and what is wrong with it, rather than "no manifest".
            return path
        if "://" in path:
            parent, _, name = path.rstrip("/").rpartition("/")
        else:
            parent, name = os.path.split(os.path.abspath(path))
        if not (is_last_name(name, self._last_names()) and name.endswith(ModelCheckpoint.FILE_EXTENSION)):
            raise FileNotFoundError(f"{path} is not a complete GoCkpt checkpoint (no manifest.json)")
        newest = gockpt.latest_checkpoint(parent, options, timeout_s)
        if newest is None:
            raise FileNotFoundError(
                f"{path} is incomplete (the run stopped while it was being saved) and {parent!r} "
                "holds no complete checkpoint")
        warnings.warn(
            f"{path} is incomplete (the run stopped while it was being saved); resuming from "
            f"{newest}, the newest complete checkpoint beside it", stacklevel=3)
        return newest


HPC_NAME = re.compile(r"hpc_ckpt_\d+\.ckpt")


def is_hpc_path(path: str, trainer: Any) -> bool:
    """Whether ``path`` is the checkpoint Lightning's SLURM signal handler saves
    (``<default_root_dir>/hpc_ckpt_<n>.ckpt``), which must be durable when the save returns.
    ``trainer`` None: False. Raises nothing."""
    if trainer is None or not HPC_NAME.fullmatch(os.path.basename(path)):
        return False
    root = str(getattr(trainer, "default_root_dir", ""))
    return os.path.abspath(os.path.dirname(path)) == os.path.abspath(root)


def tidy_hpc(directory: str, storage_options: Any) -> None:
    """Clear what a killed run's hpc saves left in ``default_root_dir`` (local): the scratch
    entries of dead writers and empty ``hpc_ckpt_<n>.ckpt`` directories. Lightning resumes a
    requeued job from the highest ``<n>`` among the names there that hold ``hpc_ckpt_``, digits
    of a scratch name included; call before it looks (at Trainer construction). Nothing is
    done for a remote ``directory``.

    Raises:
        OSError: listing or removing failed (a placeholder filled meanwhile is kept, no error).
    """
    from gockpt.fsutil import SCRATCH_RE
    from gockpt.storage import cleanup_staging

    fs, local = url_to_fs(directory, storage_options)
    if not is_local(fs) or not os.path.isdir(local):
        return
    names = os.listdir(local)
    if any((m := SCRATCH_RE.match(n)) is not None and "hpc_ckpt_" in m["name"] for n in names):
        cleanup_staging(local, storage_options)
    for name in names:
        full = os.path.join(local, name)
        if HPC_NAME.fullmatch(name) and os.path.isdir(full) and not os.path.islink(full):
            remove_placeholder(full, storage_options)


def make_placeholder(path: str, storage_options: Any) -> None:
    """Create an empty directory at a local checkpoint path that does not exist yet.

    ``save_last="link"`` links ``last.ckpt`` to a checkpoint that may still be in flight; a link
    to a missing target is dropped by Lightning's ``ckpt_path="last"`` search, which would then
    start from scratch. The publish replaces the placeholder atomically; a cancelled save removes
    it; after a crash :meth:`GoCkptIO.load_checkpoint` sees it has no manifest.
    """
    fs, local = url_to_fs(path, storage_options)
    if is_local(fs) and not os.path.lexists(local):
        os.makedirs(local, exist_ok=True)


def remove_placeholder(path: str, storage_options: Any) -> None:
    """Remove the placeholder of ``path`` if it is still an empty directory."""
    fs, local = url_to_fs(path, storage_options)
    if not is_local(fs):
        return
    try:
        if os.path.isdir(local) and not os.path.islink(local) and not os.listdir(local):
            os.rmdir(local)
    except (FileNotFoundError, NotADirectoryError):
        pass  # removed meanwhile (a rotation deleting the cancelled save of this path)
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:  # filled meanwhile: a checkpoint now, kept
            raise


def is_last_name(name: str, last_names: set[str]) -> bool:
    """Whether Lightning's ``ckpt_path="last"`` lookup takes the file ``name`` for a last
    checkpoint: it holds one of ``last_names`` (``ModelCheckpoint._find_last_checkpoints``)."""
    return any(last in name for last in last_names)


def tidy_placeholders(directory: str, storage_options: Any, *, before_resume: bool = False,
                      last_names: set[str] | None = None) -> None:
    """Remove the placeholders a stopped run left in a local checkpoint directory.

    Empty ``*.ckpt`` directories are removed; a symlink left dangling by that (``last.ckpt`` of
    ``save_last="link"``) is pointed at the newest complete checkpoint, or removed if there is
    none. Call once the run has resumed and before it saves.

    ``before_resume``: called before ``ckpt_path="last"`` is looked up. An empty ``last.ckpt``
    (a run stopped after the first checkpoint beside it was published, before its first
    ``last.ckpt`` was; any name holding one of ``last_names``, default ``{"last"}``, the
    ModelCheckpoints' ``CHECKPOINT_NAME_LAST``) is kept where the directory holds a complete
    checkpoint: the lookup then finds it and :meth:`GoCkptIO.load_checkpoint` resumes from the
    newest complete one (with a warning) rather than from scratch. The call after the resume
    removes it.
    """
    fs, local = url_to_fs(directory, storage_options)
    if not is_local(fs) or not os.path.isdir(local):
        return
    newest = None
    last_names = last_names or {ModelCheckpoint.CHECKPOINT_NAME_LAST}
    for entry in os.scandir(local):
        if entry.name.endswith(ModelCheckpoint.FILE_EXTENSION) and entry.is_dir(follow_symlinks=False) \
                and not os.listdir(entry.path):
            if before_resume and is_last_name(entry.name, last_names):
                newest = newest or gockpt.latest_checkpoint(local)
                if newest is not None:
                    continue
            os.rmdir(entry.path)
    for entry in os.scandir(local):
        if not entry.is_symlink() or os.path.exists(entry.path):
            continue
        newest = newest or gockpt.latest_checkpoint(local)
        if newest is None:
            os.unlink(entry.path)
            continue
        # The scratch name is one cleanup_staging recognises should this process die here.
        tmp = os.path.join(local, f".{entry.name}.gockpt-tmp-{os.getpid()}-{uuid.uuid4().hex}")
        os.symlink(os.path.relpath(newest, local), tmp)
        os.replace(tmp, entry.path)
        warnings.warn(
            f"{entry.path} named a checkpoint its run did not finish; it now names {newest}, the "
            "newest complete checkpoint (resuming from it with ckpt_path='last')", stacklevel=2)


def _to(tree: Any, map_location: Any) -> Any:
    import torch

    if not isinstance(map_location, (str, torch.device)):
        return tree
    return map_tree(tree, lambda x: x.to(map_location) if isinstance(x, torch.Tensor) else x)
