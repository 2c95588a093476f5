"""Attach GoCkpt to a prepared ``Accelerator``: ``save_state`` stops training only for the stall.

Call sequence of one ``accelerator.save_state()`` once attached:

1. (training thread, every process) the main process asks the engine for a checkpoint of the
   unwrapped model and the inner optimizers into a staging location and broadcasts where it
   goes and at which update it will be captured; the call returns after the engine's stall.
2. (training thread) at the captured step (GoCkpt §4.2: K-1 updates later in the multi-step
   modes) the main process's ``state_fn`` takes RNG, schedulers, scaler, dataloader state,
   registered objects and ``Accelerator.step``; the other processes take their RNG state
   (:mod:`._ranks`).
3. (engine threads) copy, replay and persist the engine's own checkpoint (GoCkpt §4.3-§4.4).
4. (publisher thread, main process) rewrite it in Accelerate's layout and rename it into
   place, then apply ``total_limit`` (:mod:`._publish`), so plain ``accelerator.load_state``
   resumes from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.utils import broadcast_object_list
from torch import nn

import gockpt
from gockpt import _exit
from gockpt.storage import cleanup_staging

from . import _host_state, _publish
from ._models import engine_model
from ._ranks import RankCapture

if TYPE_CHECKING:
    from .plugin import GoCkptPlugin

log = logging.getLogger("accelerate_gockpt")

STAGING_NAME = ".gockpt-staging"
"""Folder beside an explicit ``output_dir`` holding its unfinished checkpoint; removed when empty.

With automatic naming the unfinished ones are hidden entries of ``checkpoints/`` itself, named
``.0-<name>...``: Accelerate orders that folder by the first run of digits in each name, so a
leftover of a killed process sorts first and plain ``load_state()`` never picks it."""

_PATCHED = ("save_state", "load_state", "accumulate", "end_training")


class AccelerateSave:
    """One ``save_state`` request on the main process.

    Attributes:
        path: the checkpoint directory it publishes.
        handle: the engine's :class:`gockpt.SaveHandle` (its own staging checkpoint).
    """

    def __init__(self, seq: int, job: _publish.PublishJob, handle: gockpt.SaveHandle) -> None:
        self._seq = seq
        self._job = job
        self.path = job.final
        self.handle = handle
        self._published: Future[gockpt.CheckpointMetrics] = Future()

    def done(self) -> bool:
        """Whether it is published, failed or skipped."""
        return self._published.done()

    def result(self, timeout_s: float | None = None) -> gockpt.CheckpointMetrics:
        """Block until published in Accelerate's layout; returns the engine's metrics.

        Raises:
            TimeoutError: not done within ``timeout_s`` seconds.
            The error of the engine's save or of the publish.
        """
        return self._published.result(timeout_s)


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
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._published_seq: dict[str, int] = {}
        self._cleaned: set[str] = set()
        self._closed = False
        self._stopping = False
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="gockpt-accelerate-publish")
        self._staging_lock = threading.Lock()
        self._logged = 0  # self.metrics[:_logged] went to the trackers
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
            RuntimeError: an earlier checkpoint failed in the background; closed.
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
            record.handle.add_done_callback(lambda _h: self._submit(record))
        self.accelerator.project_configuration.iteration += 1
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
        out = []
        if self.engine is not None:
            self.engine.wait(timeout_s)
            for s in list(self.saves):
                try:
                    out.append(s.result(timeout_s))
                except TimeoutError:
                    raise
                except BaseException:  # noqa: BLE001 - raised once, below
                    pass
            self.saves = [s for s in self.saves if not s.done()]
        if self._ranks is not None:
            self._ranks.wait(timeout_s)
        self._log_published()
        self._raise_errors()
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
            self._publisher.shutdown(wait=True)
            for name in _PATCHED:
                self.accelerator.__dict__.pop(name, None)
            _exit.unregister(self._exit_token)
        self._raise_errors()

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        if self._main:
            self.engine = gockpt.Engine(self._engine_model, self._optimizers, self._config)
            if len(self._models) > 1:
                # The engine's forward pre-hook sits on a container that is never called.
                self._model_hooks = [m.register_forward_pre_hook(lambda *_a: self._boundary())
                                     for m in self._models]
        else:
            acc = self.accelerator
            self._ranks = RankCapture(self._models, self._optimizers,
                                      lambda: _host_state.rng_states(acc.step), acc.process_index)

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
            self._raise_errors()
            if root is not None and (os.path.exists(final) or any(
                    s.path == final and not s.done() for s in self.saves)):
                raise ValueError(
                    f"Checkpoint directory {final} ({self.accelerator.save_iteration}) already "
                    "exists. Please manually override `self.save_iteration` with what iteration "
                    "to start with.")
            staging_root = root if root is not None else _staging_root(final)
            name = f"0-{os.path.basename(final)}"  # see STAGING_NAME
            tag = f"{os.getpid()}-{uuid.uuid4().hex}"
            with self._staging_lock:  # the publisher removes an empty staging folder
                os.makedirs(staging_root, exist_ok=True)
                if staging_root not in self._cleaned:
                    cleanup_staging(staging_root)  # left by processes that died mid-save
                    self._cleaned.add(staging_root)
                staging = os.path.join(staging_root, f".{name}.gockpt-tmp-{tag}")
                os.mkdir(staging)
            engine_root = self.plugin.gockpt_dir or staging_root
            sep = "" if engine_root.endswith("/") else "/"
            engine_path = f"{engine_root}{sep}.{name}-engine.gockpt-tmp-{tag}"
            assert self.engine is not None
            waiting = [s for s in self.saves if s.handle.captured_step is None]
            handle = self.engine.save(engine_path, exact_step=self._exact_step,
                                      state_fn=lambda: _host_state.main_state(self.accelerator))
        except BaseException as e:  # noqa: BLE001 - every process raises it after the broadcast
            if staging is not None:
                os.rmdir(staging)
            desc["error"] = e
            return desc, None
        job = _publish.PublishJob(
            final=final, staging=staging, gockpt_path=engine_path,
            iteration=self.accelerator.save_iteration, safe_serialization=safe_serialization,
            key_map=self._key_map, num_models=len(self._models),
            num_processes=self.accelerator.num_processes, rotate_root=root,
            total_limit=self.accelerator.project_configuration.total_limit if root else None,
            timeout_s=float(self.plugin.publish_timeout_s or 600.0),
            pre_hooks=list(self.accelerator._save_model_state_pre_hook.values()),
            models=list(self.accelerator._models),
        )
        now = [s._seq for s in waiting if s.handle.captured_step is not None]
        if handle.captured_step is not None:
            now.append(seq)
        desc.update(skipped=handle.skipped, staging=staging, now=now,
                    target=handle.requested_step + handle.metrics.num_overlap_steps - 1)
        return desc, AccelerateSave(seq, job, handle)

    def _submit(self, record: AccelerateSave) -> None:
        # On the engine's persist thread: hand over at once, the rewrite is long.
        self._publisher.submit(self._publish, record)

    def _publish(self, record: AccelerateSave) -> None:
        """Publisher thread: Accelerate's layout from the durable engine checkpoint."""
        metrics, error = self._publish_one(record)
        # Tidy before the record resolves: whoever waits on it sees the final folder state.
        with self._staging_lock:
            _remove_if_empty(_staging_root(record.path))
        if error is not None:
            record._published.set_exception(error)
        else:
            record._published.set_result(metrics)

    def _publish_one(self, record: AccelerateSave) -> tuple[Any, BaseException | None]:
        try:
            metrics = record.handle.result()
        except BaseException as e:  # noqa: BLE001 - the engine re-raises it on the training thread
            _publish.discard(record._job)
            return None, e
        try:
            if metrics.skipped or self._published_seq.get(record.path, -1) > record._seq:
                _publish.discard(record._job)
            else:
                _publish.publish(record._job, metrics, lambda: self._stopping)
                self._published_seq[record.path] = record._seq
                self.metrics.append(dataclasses.replace(metrics, path=record.path))
                log.info("gockpt: published %s (captured step %s, stall %.4f s)",
                         record.path, metrics.captured_step, metrics.stall_s)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            with self._lock:
                self._errors.append(e)
            return None, e
        return metrics, None

    # ------------------------------------------------------------------ errors

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GoCkpt is detached from this accelerator (closed)")

    def _raise_errors(self) -> None:
        if self._errors:
            with self._lock:
                e = self._errors.pop(0)
            raise RuntimeError(f"gockpt: publishing a checkpoint failed: {e}") from e


def _staging_root(final: str) -> str:
    return os.path.join(os.path.dirname(final), STAGING_NAME)


def _remove_if_empty(folder: str) -> None:
    # Only the explicit-output_dir staging folder is ours to remove; it may be shared by
    # several saves, so it goes only when empty (rmdir refuses otherwise).
    try:
        os.rmdir(folder)
    except OSError:
        pass
