"""Attach GoCkpt to a prepared ``Accelerator``: ``save_state`` stops training only for the stall.

Call sequence of one ``accelerator.save_state()`` once attached:

1. (training thread, every process) the main process makes the checkpoint's staging folder and
   asks the engine for a save of the unwrapped model and the inner optimizers with an
   :class:`~._publish.AccelerateWriter`; it broadcasts the folder and the update at which the
   save will be captured; the call returns after the engine's stall.
2. (training thread) at the captured step (GoCkpt §4.2: K-1 updates later in the multi-step
   modes) the main process's ``state_fn`` takes RNG, schedulers, scaler, dataloader state,
   registered objects and ``Accelerator.step``; the other processes write their RNG state into
   the folder (:mod:`gockpt.ranks`).
3. (engine threads) copy, replay and write Accelerate's files once, straight from the host
   snapshot (:mod:`._publish`), then rename the folder into place and apply ``total_limit``
   (:mod:`gockpt.folder`), so plain ``accelerator.load_state`` resumes from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.utils import broadcast_object_list, gather_object
from torch import nn

import gockpt
from gockpt import _exit
from gockpt.folder import StagingFolders, check_before_load, folder_number, latest_numbered
from gockpt.fsutil import path_key, remove_local
from gockpt.replicated import ReplicatedEngine
from gockpt.snapshot import host_copy
from gockpt.wrapped import engine_model

from . import _host_state, _publish, _sharded

if TYPE_CHECKING:
    from .plugin import GoCkptPlugin

log = logging.getLogger("accelerate_gockpt")

_PATCHED = ("save_state", "load_state", "accumulate", "end_training")


class GoCkptCheckpointer:
    """GoCkpt attached to one prepared ``Accelerator`` (create it with :func:`attach`).

    While attached, the accelerator's ``save_state``, ``load_state``, ``accumulate`` and
    ``end_training`` are this object's. Call ``accelerator.end_training()`` or :meth:`close`
    on every process at the end, so the last checkpoints are finished.

    Attributes:
        accelerator: the accelerator.
        plugin: the resolved options.
        engine: the :class:`gockpt.Engine` (main process only, else None).
        saves: the engine's handles of the main process's requests not yet waited for, oldest
            first (empty on other processes); ``handle.path`` is the checkpoint folder.
        metrics: the engine's metrics of every checkpoint published so far, with ``path`` the
            published folder (main process).
        automatic: attached at ``prepare`` without a call in the script (``GOCKPT_ENABLED=1``
            or ``accelerate_gockpt.run``); an explicit :func:`attach` replaces it.
    """

    def __init__(self, accelerator: Any, plugin: GoCkptPlugin) -> None:
        self.accelerator = accelerator
        self.plugin = plugin
        self._rep: ReplicatedEngine | _sharded.ShardedSaves | None = None
        self._at_boundary: _host_state.AtBoundary | None = None  # see _note_boundary
        self.automatic = False  # attached at prepare (accelerate_gockpt.run): attach() replaces it
        self._published: list[gockpt.CheckpointMetrics] = []  # of engines replaced since
        self._config = plugin.to_config()
        self._main = accelerator.is_main_process
        self._models = [accelerator.unwrap_model(m) for m in accelerator._models]
        self._optimizers = [o.optimizer for o in accelerator._optimizers]
        self._check_sharded()
        self._engine_model, self._key_map = engine_model(accelerator._models, self._models)
        # The engine counts updates of any optimizer: with several, K-1 updates after a request
        # can end between two optimizers' steps of one iteration, which no loop resumes from.
        self._exact_step = bool(plugin.exact_step) or len(self._optimizers) > 1
        if self._exact_step and not plugin.exact_step:
            log.warning("gockpt: %d optimizers: every checkpoint holds the step of its request "
                        "(exact_step)", len(self._optimizers))
        self._staging = StagingFolders()
        self._closed = False
        self._stopping = False
        self._hooked_loaders: list[weakref.ref] = []
        self._requests_since_sync = 0  # save_state calls since load_state last synchronised
        self._start()
        self._hook_loaders()
        self._originals = {name: getattr(accelerator, name) for name in _PATCHED}
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state
        accelerator.accumulate = self._accumulate
        accelerator.end_training = self._end_training
        # Stock save_state is done when it returns: a script whose last call is save_state()
        # (no end_training) still gets its checkpoint, finished when the process exits.
        self._exit_token = _exit.register(self._close_at_exit)

    # ------------------------------------------------------------------ public API

    @property
    def engine(self) -> gockpt.Engine | None:
        return self._rep.engine if self._rep is not None else None

    @property
    def saves(self) -> list[gockpt.SaveHandle]:
        return self._rep.saves if self._rep is not None else []

    @property
    def metrics(self) -> list[gockpt.CheckpointMetrics]:
        return self._published + (self._rep.metrics if self._rep is not None else [])

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Path:
        """``Accelerator.save_state`` through GoCkpt; returns after the engine's stall.

        Call on every process at a step boundary (after the optimizer and scheduler steps,
        at an accumulation boundary: gradients are not saved). The checkpoint holds its
        captured step: the request's in the modes ``sync``/``async``/``lazy`` or with
        ``exact_step``, K-1 optimizer updates later in the multi-step modes (GoCkpt §4.2), with
        RNG, schedulers, scaler, dataloader state, registered objects and ``Accelerator.step``
        of that same step (``gockpt.json`` in the folder names it). The folder appears at the
        returned path, complete, once durable (see :attr:`saves`); with
        ``automatic_checkpoint_naming`` the checkpoints beyond ``total_limit`` are deleted only
        after it appears.

        Args:
            output_dir: the checkpoint folder (ignored with automatic naming, as in Accelerate).
            safe_serialization: weights as safetensors (True) or ``torch.save`` (False).
            save_model_func_kwargs: accepted for signature compatibility (DeepSpeed only).

        Returns:
            The checkpoint folder (not yet written).

        Raises:
            ValueError: the automatically named folder exists or is being written; no
                ``output_dir`` without automatic naming.
            RuntimeError: closed.
            The error of an earlier checkpoint that failed in the background, with its own type
            (``gockpt.CheckpointStorageError`` ..., or what a pre-hook raised).
        """
        self._check_open()
        self._requests_since_sync += 1  # every process calls save_state: the same count on each
        self._follow_prepared()
        self._hook_loaders()  # a loader prepared since, or iterating now: its boundary too
        final, root = self._resolve_dir(output_dir)
        assert self._rep is not None
        acc = self.accelerator
        # The path as stock returns it: the folder as named (relative stays relative).
        shown = (os.path.join(acc.project_dir, "checkpoints", f"checkpoint_{acc.save_iteration}")
                 if root is not None else os.fspath(output_dir))
        if isinstance(self._rep, _sharded.ShardedSaves):  # FSDP2: every process saves its shards
            self._rep.save(final, iteration=acc.save_iteration, exact_step=self._exact_step, rotate_root=root,
                           total_limit=acc.project_configuration.total_limit if root else None)
        else:
            # Pre-hooks run here, on this thread, as stock runs them: the save then holds the
            # step of its request, the step the hooks saw. Stock runs them on every process:
            # the main one in _prepare (with the staging folder its files go in), the others
            # here, with the checkpoint folder as stock passes it, their errors raised here.
            hooked = bool(acc._save_model_state_pre_hook)
            hook_error = None
            if hooked and not self._main:
                try:
                    weights = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
                    for hook in list(acc._save_model_state_pre_hook.values()):
                        hook(acc._models, weights, final)
                except Exception as e:  # noqa: BLE001 - raised after the request's exchange
                    hook_error = e
            # Every process takes part in the request's exchange (a collective), a hook's error
            # on this one included; then that error is raised here, as stock's save_state does.
            # A save still to be captured that this request finishes (no host slot for both)
            # is captured here: with step and RNG as of here, as the counters and loaders it
            # takes live (under accumulation a step's later micro-steps move them).
            self._note_boundary(request=True)
            self._rep.save(final, lambda: self._prepare(final, root, safe_serialization),
                           exact_step=self._exact_step or hooked,
                           state_fn=self._host_files)
            self._note_boundary(request=True)
            if hook_error is not None:
                raise hook_error
        self.accelerator.project_configuration.iteration += 1
        self._log_published()
        return Path(shown)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """``Accelerator.load_state``, after finishing pending saves (on every process: the
        folder it loads is published for all of them); restores the iteration.

        With several processes, where ``save_state`` was called since the last ``load_state``,
        call it on every process (it waits for all of them); otherwise it runs no collective,
        as stock's, and may be called on the main process alone.

        With ``input_dir=None`` and automatic naming it loads the highest-numbered checkpoint
        (every one there is complete). Afterwards ``project_configuration.iteration`` is at
        least one past the loaded checkpoint's, so the next ``save_state`` does not collide with
        it; it never goes back (a rollback to an older folder saves the next one under a new
        number, as stock's unchanged counter does).

        Before Accelerate's loader reads the folder, a folder GoCkpt wrote is checked against
        its manifest (sizes, and checksums with ``verify_on_load``), and a FIFO, device or
        socket in any folder is refused (:func:`gockpt.folder.check_before_load`).

        Raises:
            FileNotFoundError: automatic naming and no checkpoint in ``project_dir/checkpoints``.
            gockpt.CheckpointCorruptError: a file of the folder is corrupt or not a regular file
                (named in the message); nothing was loaded.
            RuntimeError: a pending checkpoint failed on another process (this one's own
                error, with its type, where it had one).
            What ``Accelerator.load_state`` raises.
        """
        self._check_open()
        self._wait_everywhere()
        acc = self.accelerator
        pc = acc.project_configuration
        if input_dir is None and pc.automatic_checkpoint_naming:
            input_dir = latest_numbered(os.path.join(acc.project_dir, "checkpoints"))
        elif input_dir is not None:
            input_dir = os.path.expanduser(os.fspath(input_dir))  # as stock's loader takes it
        self._stop()  # load_state_dict replaces optimizer state tensors: re-enumerate them
        try:
            if input_dir is not None and self._sharded and _sharded.is_sharded_checkpoint(os.fspath(input_dir)):
                number = _sharded.load(acc, os.fspath(input_dir), self._models[0], self._optimizers,
                                       verify=self._config.verify_on_load)
                pc.iteration = max(pc.iteration, number + 1)
                return
            if input_dir is not None and os.path.isdir(input_dir):
                # Accelerate's loader checks no checksum and opens a FIFO as a file.
                check_before_load(os.fspath(input_dir), verify=self._config.verify_on_load)
            self._originals["load_state"](input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            self._start()
        if input_dir is None:
            return
        # GoCkpt's folders name their iteration; Accelerate's own are numbered in their name.
        number = folder_number(os.fspath(input_dir), _publish.SIDECAR_FORMAT, "iteration",
                               from_name=pc.automatic_checkpoint_naming)
        if number is not None:
            # Never back: after a rollback to an older folder the next save is a new number
            # (stock leaves the counter where it was).
            pc.iteration = max(pc.iteration, number + 1)

    def wait(self, timeout_s: float | None = None) -> list[gockpt.CheckpointMetrics]:
        """Finish every pending checkpoint now and block until published (the main process;
        another returns once its own files of them are written: :meth:`load_state` also waits
        for the main process).

        Checkpoints still in their copy windows are captured at the current step. Call on
        every process at the same point (each one takes its RNG state there).

        Returns:
            Metrics of the checkpoints finished since the last wait, skipped ones included
            (main process; else empty).

        Raises:
            The first background error; TimeoutError after ``timeout_s`` seconds.
        """
        out = self._rep.wait(timeout_s) if self._rep is not None else []
        self._log_published()
        return out

    def _wait_everywhere(self) -> None:
        """:meth:`wait` on every process, then until every process has: the main process
        publishes the checkpoints, so a folder one of them reads next is there for all of
        them. An error of one process's wait is raised on each (its own where it has one)."""
        acc = self.accelerator
        if acc.num_processes == 1 or not self._requests_since_sync:
            # Nothing requested since the last time: no collective (stock's load_state has
            # none, and a script may call it on the main process alone).
            self.wait()
            return
        self._requests_since_sync = 0
        error: BaseException | None = None
        try:
            self.wait()
        except Exception as e:  # the others learn of it below rather than wait for this one
            error = e
        failed = [m for m in gather_object([None if error is None else f"{type(error).__name__}: {error}"])
                  if m is not None]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"gockpt: a pending checkpoint failed on another process: {failed[0]}")

    def _log_published(self) -> None:
        # Training thread: trackers are not thread-safe. One entry per published checkpoint.
        acc = self.accelerator
        new = self._rep.take_published() if self._rep is not None else []
        for m in new if acc.trackers and self.plugin.log_metrics else []:
            acc.log(m.log_dict(), step=acc.step)

    def close(self) -> None:
        """:meth:`wait`, then detach: the accelerator's own methods are back, hooks removed.

        Raises:
            The first background error not raised before.
        """
        if self._closed:
            return
        # FSDP2: finishing is collective. Where the run is ending by an exception (a finally,
        # the exit hook after an uncaught one), the other processes may be anywhere (in a
        # collective of the next step, or dead): this process finishes its own part only, and
        # the main one commits what every process completed.
        alone = self._sharded and _exit.stopped_by_exception()
        try:
            if not alone:
                self.wait()
        finally:
            self._closed = True
            self._stopping = True
            self._stop(collective=not alone)
            self._unhook_loaders()
            for name in _PATCHED:
                self.accelerator.__dict__.pop(name, None)
            _exit.unregister(self._exit_token)

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        acc = self.accelerator
        self._at_boundary = None
        if self._sharded:
            self._rep = _sharded.ShardedSaves(acc, self._models[0], self._optimizers, self._config)
            return
        broadcast = (lambda obj: broadcast_object_list([obj])[0]) if acc.num_processes > 1 else None
        self._rep = ReplicatedEngine(
            self._engine_model, self._optimizers, self._config, is_writer=self._main,
            share=lambda: self._host_files(rng_only=True)[_host_state.rng_file_name(acc.process_index)],
            share_name=_host_state.rng_file_name(acc.process_index), broadcast=broadcast,
            boundary_modules=self._models if len(self._models) > 1 else ())

    def _stop(self, collective: bool = True) -> None:
        rep, self._rep = self._rep, None
        if rep is not None:
            try:
                if isinstance(rep, _sharded.ShardedSaves):
                    rep.close(collective=collective)
                else:
                    rep.close()
            finally:
                self._published += rep.metrics

    def _close_at_exit(self) -> None:
        if self._closed:
            return
        try:
            self.close()
        except BaseException:  # noqa: BLE001 - nobody is left to raise to
            log.exception("gockpt: finishing checkpoints at exit failed")

    def _follow_prepared(self) -> None:
        # After free_memory() and a new prepare(), the accelerator holds other objects: save those.
        acc = self.accelerator
        models = [acc.unwrap_model(m) for m in acc._models]
        optimizers = [o.optimizer for o in acc._optimizers]
        if (list(map(id, models)) == list(map(id, self._models))
                and list(map(id, optimizers)) == list(map(id, self._optimizers))):
            return
        if not models or not optimizers:
            raise ValueError("save_state with GoCkpt needs a prepared model and optimizer "
                             "(free_memory() released them)")
        self.wait()
        self._stop()
        self._models, self._optimizers = models, optimizers
        self._check_sharded()
        self._engine_model, self._key_map = engine_model(acc._models, self._models)
        self._start()
        self._hook_loaders()

    def _end_training(self) -> None:
        original = self._originals["end_training"]
        try:
            self.close()
        finally:
            original()

    @contextlib.contextmanager
    def _accumulate(self, *models: nn.Module) -> Iterator[None]:
        # The start of an iteration, before Accelerate advances its step counter: a boundary.
        self._boundary()
        with self._originals["accumulate"](*models):
            yield

    def _boundary(self) -> None:
        rep = self._rep
        if rep is None:
            return
        rep.boundary()
        self._note_boundary()
        if rep.capture_pending:  # a loader begun since the request: its end too
            self._hook_loaders()

    def _note_boundary(self, *, request: bool = False) -> None:
        """At a request, or the first boundary since an update while a save is still to be
        captured: a capture at this step after the loop went on (a flush when a run fails
        inside the next iteration) takes step and RNG as of here, as stock's save_state of
        this step holds them."""
        rep = self._rep
        if not isinstance(rep, ReplicatedEngine) or not rep.capture_pending:
            return
        version = rep.version
        if request or self._at_boundary is None or self._at_boundary.version != version:
            self._at_boundary = _host_state.AtBoundary.take(self.accelerator, version)

    def _boundary_state(self) -> _host_state.AtBoundary | None:
        """The state of the first boundary of the current step, if one was taken."""
        at = self._at_boundary  # taken only under a ReplicatedEngine (_note_boundary)
        return at if at is not None and self._rep is not None and at.version == self._rep.version else None

    def _host_files(self, *, rng_only: bool = False) -> dict[str, bytes]:
        """:func:`_host_state.host_files` of the captured step: as of its first boundary."""
        with _host_state.as_of(self.accelerator, self._boundary_state()):
            return _host_state.host_files(self.accelerator, rng_only=rng_only)

    def _hook_loaders(self) -> None:
        """Take a step boundary where the loop asks a prepared dataloader for its next batch.

        That is where a stock ``save_state`` of the step before would have run. Later (at
        ``accumulate`` or the forward) the loader has yielded that batch and fetched the one
        after it, drawing from the RNG and moving its state: a multi-step checkpoint's RNG
        and dataloader state taken there would be a batch ahead of its tensors. Accelerate's
        loaders call ``_update_state_dict()`` when asked for a batch, before fetching the next
        one, and ``end()`` when asked past the last: both are wrapped (instance attributes,
        removed by :meth:`close`) to call the boundary first.

        A loader from ``skip_first_batches`` (the first epoch of a resumed run, the
        accelerator's method or the module's function) is not among the prepared ones: it is
        hooked while it iterates (Accelerate's gradient state holds it then), at a request and
        at each boundary while a save is still to be captured.
        """
        acc = self.accelerator
        active = getattr(acc.gradient_state, "dataloader_references", None) or ()
        for dl in [*acc._dataloaders, *(a for a in active if a is not None)]:
            self._hook_loader(dl)

    def _hook_loader(self, dl: Any) -> None:
        if any(n in vars(dl) for n in _LOADER_HOOKS):
            return  # hooked already
        hooked = False
        for name in _LOADER_HOOKS:
            original = getattr(dl, name, None)
            if callable(original):
                setattr(dl, name, _with_boundary(original, self._boundary))
                hooked = True
        if hooked:  # weakly: a loader the script drops goes (with its worker processes)
            self._hooked_loaders.append(weakref.ref(dl))

    def _unhook_loaders(self) -> None:
        for ref in self._hooked_loaders:
            dl = ref()
            for name in _LOADER_HOOKS if dl is not None else ():
                vars(dl).pop(name, None)
        self._hooked_loaders = []

    # ------------------------------------------------------------------ save helpers

    def _resolve_dir(self, output_dir: str | os.PathLike | None) -> tuple[str, str | None]:
        acc = self.accelerator
        pc = acc.project_configuration
        if pc.automatic_checkpoint_naming:
            root = os.path.abspath(os.path.join(acc.project_dir, "checkpoints"))
            return os.path.join(root, f"checkpoint_{pc.iteration}"), root
        if output_dir is None:
            raise ValueError("save_state needs output_dir unless automatic_checkpoint_naming is set")
        return os.path.abspath(os.fspath(output_dir)), None  # no "~" expansion, as stock

    def _prepare(self, final: str, root: str | None,
                 safe_serialization: bool) -> tuple[str, _publish.AccelerateWriter]:
        """Main process, at the request: the staging folder and the checkpoint's writer."""
        key = path_key(final)  # the engine's handles carry that spelling (Engine.save)
        if root is not None and (os.path.exists(final) or any(
                h.path == key and not h.done() for h in self.saves)):
            raise ValueError(
                f"Checkpoint directory {final} ({self.accelerator.save_iteration}) already "
                "exists. Please manually override `self.save_iteration` with what iteration "
                "to start with.")
        staging = self._staging.make(final)
        acc = self.accelerator
        weights = None
        hooks = list(acc._save_model_state_pre_hook.values())
        if hooks:
            # As Accelerator.save_state: the live state dicts, the hooks with the folder being
            # written (files they save land in the checkpoint), then what is left is copied to
            # the host and written (the copy is this save's stall, as stock's write is).
            weights = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
            try:
                for hook in hooks:
                    hook(acc._models, weights, staging)
                weights = [host_copy(sd)[0] for sd in weights]
            except BaseException:
                remove_local(staging)
                raise
        return staging, _publish.AccelerateWriter(
            staging=staging, key_map=self._key_map, num_models=len(self._models),
            safe_serialization=safe_serialization,
            sidecar_fields={"iteration": acc.save_iteration, "num_processes": acc.num_processes},
            shares=[_host_state.rng_file_name(r) for r in range(1, acc.num_processes)],
            rotate_root=root, total_limit=acc.project_configuration.total_limit if root else None,
            timeout_s=float(self.plugin.publish_timeout_s or 600.0),
            hooked_weights=weights, stopped=lambda: self._stopping,
            claim_directory=root is not None)

    # ------------------------------------------------------------------ errors

    def _check_sharded(self) -> None:
        # FSDP2 (DTensor parameters): every process saves its shards (accelerate_gockpt._sharded).
        self._sharded = any(_sharded.holds_shards(m) for m in self._models)
        if self._sharded and len(self._models) != 1:
            raise NotImplementedError("GoCkpt saves one FSDP2 model per accelerator; "
                                      f"{len(self._models)} are prepared")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GoCkpt is detached from this accelerator (closed)")


#: The methods of Accelerate's prepared dataloaders that run when the loop asks for a batch:
#: ``_update_state_dict`` before the next one is fetched, ``end`` past the last one.
_LOADER_HOOKS = ("_update_state_dict", "end")


def _with_boundary(original: Any, boundary: Any) -> Any:
    # The loader's own method weakly: the hook is an attribute of that loader, and a strong
    # reference would make a cycle that keeps a dropped loader (and its worker processes) alive
    # until the cyclic collector runs.
    method = weakref.WeakMethod(original)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        boundary()
        return method()(*args, **kwargs)
    return hooked
