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
   snapshot, then rename the folder into place and apply ``total_limit`` (:mod:`._publish`), so
   plain ``accelerator.load_state`` resumes from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.utils import RNG_STATE_NAME, broadcast_object_list
from torch import nn

import gockpt
from gockpt import _exit
from gockpt._hooks import EngineHook
from gockpt.ranks import RankCapture
from gockpt.storage import cleanup_staging

from . import _host_state, _publish
from ._models import engine_model

if TYPE_CHECKING:
    from .plugin import GoCkptPlugin

log = logging.getLogger("accelerate_gockpt")

_PATCHED = ("save_state", "load_state", "accumulate", "end_training")


class AccelerateSave:
    """One ``save_state`` request on the main process.

    Attributes:
        path: the checkpoint directory it publishes.
        handle: the engine's :class:`gockpt.SaveHandle`; done when the folder is in place.
    """

    def __init__(self, seq: int, path: str, handle: gockpt.SaveHandle) -> None:
        self._seq = seq
        self.path = path
        self.handle = handle

    def done(self) -> bool:
        """Whether it is published, failed or skipped."""
        return self.handle.done()

    def result(self, timeout_s: float | None = None) -> gockpt.CheckpointMetrics:
        """Block until published in Accelerate's layout; returns the engine's metrics.

        Raises:
            TimeoutError: not done within ``timeout_s`` seconds.
            The error of the save.
        """
        return self.handle.result(timeout_s)


class GoCkptCheckpointer:
    """GoCkpt attached to one prepared ``Accelerator`` (create it with :func:`attach`).

    While attached, the accelerator's ``save_state``, ``load_state``, ``accumulate`` and
    ``end_training`` are this object's. Call ``accelerator.end_training()`` or :meth:`close`
    on every process at the end, so the last checkpoints are finished.

    Attributes:
        accelerator: the accelerator.
        plugin: the resolved options.
        engine: the :class:`gockpt.Engine` (main process only, else None).
        saves: the main process's requests not yet waited for, oldest first (empty on other
            processes).
        metrics: the engine's metrics of every checkpoint published so far, with ``path`` the
            published folder (main process).
    """

    def __init__(self, accelerator: Any, plugin: GoCkptPlugin) -> None:
        self.accelerator = accelerator
        self.plugin = plugin
        self.engine: gockpt.Engine | None = None
        self.saves: list[AccelerateSave] = []
        self.metrics: list[gockpt.CheckpointMetrics] = []
        self._config = plugin.to_config()
        self._main = accelerator.is_main_process
        self._models = [accelerator.unwrap_model(m) for m in accelerator._models]
        self._optimizers = [o.optimizer for o in accelerator._optimizers]
        self._engine_model, self._key_map = engine_model(accelerator._models, self._models)
        # The engine counts updates of any optimizer: with several, K-1 updates after a request
        # can end between two optimizers' steps of one iteration, which no loop resumes from.
        self._exact_step = bool(plugin.exact_step) or len(self._optimizers) > 1
        if self._exact_step and not plugin.exact_step:
            log.warning("gockpt: %d optimizers: every checkpoint holds the step of its request "
                        "(exact_step)", len(self._optimizers))
        self._ranks: RankCapture | None = None
        self._model_hooks: list = []
        self._seq = 0
        self._cleaned: set[str] = set()
        self._closed = False
        self._stopping = False
        self._logged = 0  # self.metrics[:_logged] went to the trackers
        self._finished: list[gockpt.CheckpointMetrics] = []  # since the last wait()
        self._start()
        self._originals = {name: getattr(accelerator, name) for name in _PATCHED}
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state
        accelerator.accumulate = self._accumulate
        accelerator.end_training = self._end_training
        # Stock save_state is done when it returns: a script whose last call is save_state()
        # (no end_training) still gets its checkpoint, finished when the process exits.
        self._exit_token = _exit.register(self._close_at_exit)

    # ------------------------------------------------------------------ public API

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
        self._follow_prepared()
        final, root = self._resolve_dir(output_dir)
        if self._main:
            desc, record = self._request(final, root, safe_serialization)
        else:
            assert self._ranks is not None
            self._ranks.boundary()  # the main process's engine.save() is a boundary as well
            desc, record = None, None
        if self.accelerator.num_processes > 1:
            sent = desc
            if desc is not None and desc["error"] is not None:
                sent = {**desc, "error": f"{type(desc['error']).__name__}: {desc['error']}"}
            received = broadcast_object_list([sent])[0]
            desc = desc if self._main else received
        assert desc is not None
        if desc["error"] is not None:
            if isinstance(desc["error"], BaseException):
                raise desc["error"]
            raise RuntimeError(f"gockpt: save_state failed on the main process: {desc['error']}")
        if self._ranks is not None:
            if not desc["skipped"]:
                self._ranks.add(desc["seq"], desc["staging"], desc["target"])
            self._ranks.capture(desc["now"])
            self._ranks.check()
        if record is not None:
            self.saves.append(record)
        self.accelerator.project_configuration.iteration += 1
        self._harvest()
        self._log_published()
        return Path(final)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """``Accelerator.load_state``, after finishing pending saves; restores the iteration.

        With ``input_dir=None`` and automatic naming it loads the highest-numbered checkpoint
        (every one there is complete). Afterwards ``project_configuration.iteration`` is one
        past the loaded checkpoint's, so the next ``save_state`` does not collide with it.

        Raises:
            FileNotFoundError: automatic naming and no checkpoint in ``project_dir/checkpoints``.
            What ``Accelerator.load_state`` raises.
        """
        self._check_open()
        self.wait()
        acc = self.accelerator
        pc = acc.project_configuration
        if input_dir is None and pc.automatic_checkpoint_naming:
            root = os.path.join(acc.project_dir, "checkpoints")
            names = _publish.numbered(root)
            if not names:
                raise FileNotFoundError(f"no checkpoint in {root}")
            input_dir = os.path.join(root, names[-1])
        self._stop()  # load_state_dict replaces optimizer state tensors: re-enumerate them
        try:
            self._originals["load_state"](input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            self._start()
        if input_dir is None:
            return
        sidecar = _publish.read_sidecar(os.fspath(input_dir))
        if sidecar is not None:
            pc.iteration = int(sidecar["iteration"]) + 1
        elif pc.automatic_checkpoint_naming:
            number = _publish.checkpoint_number(os.path.basename(os.path.normpath(input_dir)))
            if number is not None:
                pc.iteration = number + 1

    def wait(self, timeout_s: float | None = None) -> list[gockpt.CheckpointMetrics]:
        """Finish every pending checkpoint now and block until published.

        Checkpoints still in their copy windows are captured at the current step. Call on
        every process at the same point (each one takes its RNG state there).

        Returns:
            Metrics of the checkpoints finished since the last wait, skipped ones included
            (main process; else empty).

        Raises:
            The first background error; TimeoutError after ``timeout_s`` seconds.
        """
        if self.engine is not None:
            self.engine.wait(timeout_s)
            for s in list(self.saves):
                try:
                    s.result(timeout_s)
                except TimeoutError:
                    raise
                except BaseException:  # noqa: BLE001 - raised once, below
                    pass
        self._harvest()
        out, self._finished = self._finished, []
        if self._ranks is not None:
            self._ranks.wait(timeout_s)
        self._log_published()
        return out

    def _log_published(self) -> None:
        # Training thread: trackers are not thread-safe. One entry per published checkpoint.
        acc = self.accelerator
        new, self._logged = self.metrics[self._logged:], len(self.metrics)
        if not acc.trackers:
            return
        for m in new:
            acc.log({"gockpt/stall_s": m.stall_s, "gockpt/bytes": float(m.persist_bytes),
                     "gockpt/time_to_durable_s": m.time_to_durable_s,
                     "gockpt/num_overlap_steps": float(m.num_overlap_steps),
                     "gockpt/requested_step": float(m.requested_step),
                     "gockpt/captured_step": float(m.captured_step or 0)}, step=acc.step)

    def close(self) -> None:
        """:meth:`wait`, then detach: the accelerator's own methods are back, hooks removed.

        Raises:
            The first background error not raised before.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stopping = True
            self._stop()
            for name in _PATCHED:
                self.accelerator.__dict__.pop(name, None)
            _exit.unregister(self._exit_token)

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        if self._main:
            self.engine = gockpt.Engine(self._engine_model, self._optimizers, self._config)
            if len(self._models) > 1:
                # The engine's forward pre-hook sits on a container that is never called.
                self._model_hooks = [m.register_forward_pre_hook(EngineHook(self._boundary))
                                     for m in self._models]
        else:
            acc = self.accelerator
            self._ranks = RankCapture(self._models, self._optimizers,
                                      lambda: _host_state.rng_states(acc.step),
                                      f"{RNG_STATE_NAME}_{acc.process_index}.pkl")

    def _stop(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
            if self._ranks is not None:
                self._ranks.close()
        finally:
            self.engine, self._ranks = None, None
            for h in self._model_hooks:
                h.remove()
            self._model_hooks = []

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
        self._engine_model, self._key_map = engine_model(acc._models, self._models)
        self._start()

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
        if self.engine is not None:
            self.engine.step_end()
        elif self._ranks is not None:
            self._ranks.boundary()

    # ------------------------------------------------------------------ save helpers

    def _resolve_dir(self, output_dir: str | os.PathLike | None) -> tuple[str, str | None]:
        acc = self.accelerator
        pc = acc.project_configuration
        if pc.automatic_checkpoint_naming:
            root = os.path.abspath(os.path.join(acc.project_dir, "checkpoints"))
            return os.path.join(root, f"checkpoint_{pc.iteration}"), root
        if output_dir is None:
            raise ValueError("save_state needs output_dir unless automatic_checkpoint_naming is set")
        return os.path.abspath(os.path.expanduser(os.fspath(output_dir))), None

    def _request(self, final: str, root: str | None,
                 safe_serialization: bool) -> tuple[dict[str, Any], AccelerateSave | None]:
        """Main process: ask the engine for the checkpoint; the descriptor for the others."""
        seq = self._seq
        self._seq += 1
        desc: dict[str, Any] = {"seq": seq, "error": None, "skipped": False, "staging": None,
                                "target": None, "now": []}
        staging = None
        try:
            if root is not None and (os.path.exists(final) or any(
                    s.path == final and not s.done() for s in self.saves)):
                raise ValueError(
                    f"Checkpoint directory {final} ({self.accelerator.save_iteration}) already "
                    "exists. Please manually override `self.save_iteration` with what iteration "
                    "to start with.")
            parent = root if root is not None else os.path.dirname(final)
            os.makedirs(parent, exist_ok=True)
            if parent not in self._cleaned:
                cleanup_staging(parent)  # left by processes that died mid-save
                self._cleaned.add(parent)
            # Named so that Accelerate's own ordering puts a leftover first (see _publish).
            staging = os.path.join(
                parent, f".0-{os.path.basename(final)}.gockpt-tmp-{os.getpid()}-{uuid.uuid4().hex}")
            os.mkdir(staging)
            acc = self.accelerator
            writer = _publish.AccelerateWriter(
                staging=staging, key_map=self._key_map, num_models=len(self._models),
                safe_serialization=safe_serialization, iteration=acc.save_iteration,
                num_processes=acc.num_processes, rotate_root=root,
                total_limit=acc.project_configuration.total_limit if root else None,
                timeout_s=float(self.plugin.publish_timeout_s or 600.0),
                pre_hooks=list(acc._save_model_state_pre_hook.values()),
                models=list(acc._models), stopped=lambda: self._stopping,
                claim_directory=root is not None)
            assert self.engine is not None
            waiting = [s for s in self.saves if s.handle.captured_step is None]
            handle = self.engine.save(final, exact_step=self._exact_step, writer=writer,
                                      state_fn=lambda: _host_state.main_state(acc))
        except BaseException as e:  # noqa: BLE001 - every process raises it after the broadcast
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            desc["error"] = e
            return desc, None
        handle.add_done_callback(lambda h: self._on_done(h, staging))
        now = [s._seq for s in waiting if s.handle.captured_step is not None]
        if handle.captured_step is not None:
            now.append(seq)
        desc.update(skipped=handle.skipped, staging=staging, now=now,
                    target=handle.requested_step + handle.metrics.num_overlap_steps - 1)
        return desc, AccelerateSave(seq, final, handle)

    def _on_done(self, handle: gockpt.SaveHandle, staging: str) -> None:
        # Any thread. A save that published nothing (skipped, superseded, failed before its
        # files) leaves no staging folder behind; a published one's was renamed into place.
        try:
            metrics = handle.result(0)
        except BaseException:  # noqa: BLE001 - the engine raises it on the training thread
            metrics = None
        shutil.rmtree(staging, ignore_errors=True)
        if metrics is not None and not metrics.skipped and not metrics.superseded:
            log.info("gockpt: published %s (captured step %s, stall %.4f s)",
                     metrics.path, metrics.captured_step, metrics.stall_s)

    def _harvest(self) -> list[gockpt.CheckpointMetrics]:
        # Training thread: move finished saves out of self.saves; published ones into metrics.
        out = []
        for s in [s for s in self.saves if s.done()]:
            self.saves.remove(s)
            try:
                m = s.result(0)
            except BaseException:  # noqa: BLE001 - the engine raises it on the training thread
                continue
            out.append(m)
            self._finished.append(m)
            if not m.skipped and not m.superseded:
                self.metrics.append(m)
        return out

    # ------------------------------------------------------------------ errors

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GoCkpt is detached from this accelerator (closed)")
