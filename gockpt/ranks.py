"""A process's share of a checkpoint that another process (the writer) saves.

With replicated training (DDP, Accelerate's multi-process runs) one process runs the engine and
writes the model and optimizer; every other process still owns state of its own (its RNG, ...)
that belongs to the same checkpoint, taken at the same captured step (GoCkpt §4.2: K-1 updates
after the request in the multi-step modes). :class:`RankCapture` counts optimizer updates with the
same step post-hooks the engine uses, takes that state at the writer's captured step, and writes
it into the checkpoint's staging directory, which the writer publishes once every share is there
(see ``CheckpointWriter.before_publish``). Call sequence:

1. (training thread, at the request on every process) the writer broadcasts the staging
   directory, the captured step (the target) and which earlier checkpoints it captured during
   this call (a flush when no snapshot slot was free): :meth:`add`, :meth:`capture`.
2. (training thread, first step boundary at the target: an optimizer step pre-hook, the model's
   forward pre-hook, or :meth:`boundary`) take this process's state.
3. (writer thread) write it into the staging directory atomically (:func:`write_share`).
"""

from __future__ import annotations

import io
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from time import monotonic
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._hooks import EngineHook, load_hooks
from .handle import SaveHandle

__all__ = ["RankCapture", "describe_request", "exchange_request", "wait_for_shares", "write_share"]

log = logging.getLogger("gockpt")


def write_share(staging: str, name: str, state: Any) -> bool:
    """Write ``state`` as file ``name`` of ``staging`` atomically (temp file, fsync, rename):
    ``bytes`` as they are (a file already serialized), anything else with ``torch.save``.

    Returns:
        False when ``staging`` is gone (the writer abandoned this checkpoint).

    Raises:
        OSError: the file could not be written.
    """
    if not os.path.isdir(staging):
        return False
    if isinstance(state, bytes):
        data: Any = state
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getbuffer()
    tmp = os.path.join(staging, f".{name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(staging, name))
    except FileNotFoundError:
        return False
    return True


def describe_request(seq: int, staging: str | None = None, handle: SaveHandle | None = None,
                     waiting: Sequence[tuple[int, SaveHandle]] = (),
                     error: BaseException | None = None, version: int | None = None) -> dict[str, Any]:
    """The writer's account of request ``seq`` for the other processes (step 1 of the module doc).

    Args:
        seq: the writer's request number.
        staging: the staging directory the shares go to.
        handle: the engine's handle of the request (None when it failed: ``error``).
        waiting: ``(seq, handle)`` of earlier requests not yet captured before this one; those
            captured by it (a flush for want of a slot) are captured now on every process.
        error: what the request raised on the writer.
        version: the writer's engine's update count at the request (the step all processes
            are at).

    Returns:
        ``{"seq", "staging", "target", "version", "now", "skipped", "error"}``: ``target`` the
        update at which it is captured (GoCkpt §4.2: requested + K - 1) and ``version`` the
        update count now, both counted by the writer's engine; ``now`` the requests captured at
        this call.
    """
    desc: dict[str, Any] = {"seq": seq, "staging": staging, "target": None, "version": version,
                            "now": [], "skipped": False, "error": error}
    if handle is not None:
        now = [q for q, h in waiting if h.captured_step is not None]
        if handle.captured_step is not None:
            now.append(seq)
        desc.update(target=handle.requested_step + handle.metrics.num_overlap_steps - 1,
                    now=now, skipped=handle.skipped)
    return desc


def exchange_request(desc: dict[str, Any] | None,
                     broadcast: Callable[[Any], Any] | None) -> dict[str, Any]:
    """Give every process the writer's descriptor, then raise the writer's error everywhere.

    Args:
        desc: :func:`describe_request` on the writer, None elsewhere.
        broadcast: sends the writer's object to every process and returns it (e.g. one
            ``broadcast_object_list`` element); None with one process.

    Raises:
        The writer's error: its own exception on the writer, a ``RuntimeError`` naming it on
        the others (exceptions need not pickle).
    """
    if broadcast is not None:
        sent = desc
        if desc is not None and desc["error"] is not None:
            sent = {**desc, "error": f"{type(desc['error']).__name__}: {desc['error']}"}
        received = broadcast(sent)
        desc = desc if desc is not None else received
    assert desc is not None, "the writer's descriptor"
    error = desc["error"]
    if isinstance(error, BaseException):
        raise error
    if error is not None:
        raise RuntimeError(f"gockpt: the checkpoint request failed on the writing process: {error}")
    return desc


def wait_for_shares(staging: str, names: Sequence[str], timeout_s: float,
                    stopped: Callable[[], bool] = lambda: False) -> None:
    """Block until every file of ``names`` is in ``staging`` (the other processes' shares).

    They arrive through a shared filesystem, with nothing to block on: polled every 10 ms.
    Meant for ``CheckpointWriter.before_publish`` on a persist thread.

    Raises:
        TimeoutError: some are missing after ``timeout_s`` seconds or once ``stopped()`` is true
            (names them).
    """
    deadline = monotonic() + timeout_s
    missing = list(names)
    while missing:
        missing = [n for n in missing if not os.path.exists(os.path.join(staging, n))]
        if not missing:
            return
        if stopped() or monotonic() > deadline:
            raise TimeoutError(f"{staging}: other processes did not write {missing} "
                               f"within {timeout_s:.0f} s")
        time.sleep(0.01)


class RankCapture:
    """Takes this process's share of checkpoints at the writer's captured steps.

    Args:
        models: the models (forward pre-hooks mark step boundaries).
        optimizers: the torch optimizers (post-hooks count updates as the engine does).
        take: returns this process's share (any ``torch.save``-able object, or the file's bytes).
        name: the file name of the share in the staging directory (e.g. one per rank).
        model: the module the writer's engine checkpoints: a ``load_state_dict`` into it or
            into an optimizer ends the pending checkpoints here, as it does on the writer (every
            process loads at the same point); one into a part of it ends those requested at
            this update.
    """

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer],
                 take: Callable[[], Any], name: str, model: nn.Module | None = None) -> None:
        self.version = 0
        self._take = take
        self._name = name
        self._pending: dict[int, tuple[str, int, int]] = {}  # seq -> staging, target, requested
        self._futures: list[Future[bool]] = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gockpt-rank-share")
        self._hooks = []
        for o in optimizers:
            self._hooks.append(o.register_step_post_hook(EngineHook(self._on_update)))
            self._hooks.append(o.register_step_pre_hook(EngineHook(self.boundary)))
        for m in models:
            self._hooks.append(m.register_forward_pre_hook(EngineHook(self.boundary)))
        if model is not None:  # as the writer's engine hooks it
            self._hooks += load_hooks(model, optimizers, self._before_load, self._before_part_load)

    @property
    def pending(self) -> bool:
        """Whether a checkpoint's share is still to be taken."""
        return bool(self._pending)

    def add(self, seq: int, staging: str, target: int) -> None:
        """Register checkpoint ``seq`` of the writer, requested now, captured at update
        ``target``."""
        self._pending[seq] = (staging, target, self.version)

    def follow(self, desc: dict[str, Any]) -> None:
        """Apply the writer's descriptor (:func:`exchange_request`): register, capture, check."""
        if not desc["skipped"]:
            # The writer's engine counts from the optimizers' step state (a resumed Adam starts
            # at its step), this process from its attach: the target as updates from now.
            # (A descriptor without the writer's count: the target as it is.)
            writer_now = desc["version"] if desc.get("version") is not None else self.version
            self.add(desc["seq"], desc["staging"], self.version + desc["target"] - writer_now)
        self.capture(desc["now"])
        self.check()

    def boundary(self) -> None:
        """A step boundary: take the state of checkpoints whose target is the current update."""
        for seq, (_, target, _) in list(self._pending.items()):
            if target == self.version:
                self._capture(seq)

    def capture(self, seqs: Sequence[int]) -> None:
        """Take the state of checkpoints ``seqs`` now (the writer captured them here)."""
        for seq in seqs:
            if seq in self._pending:
                self._capture(seq)

    def check(self) -> None:
        """Re-raise the first failed write on the calling (training) thread."""
        for f in self._futures:
            if f.done() and f.exception() is not None:
                self._futures.remove(f)
                raise RuntimeError("gockpt: writing this process's share of a checkpoint failed") from f.exception()

    def wait(self, timeout_s: float | None = None) -> None:
        """Take every pending checkpoint's state now and block until written.

        Call where the writer flushes (its ``wait``/``close``, on every process).

        Raises:
            The first write error.
        """
        self.capture(list(self._pending))
        futures, self._futures = self._futures, []
        for f in futures:
            f.result(timeout_s)

    def close(self) -> None:
        """:meth:`wait`, then remove the hooks and stop the writer thread."""
        try:
            self.wait()
        finally:
            for h in self._hooks:
                h.remove()
            self._writer.shutdown(wait=True)

    def _on_update(self) -> None:
        self.version += 1

    def _before_load(self) -> None:
        # As the writer's engine (Engine._before_load): a restore ends every pending capture.
        self.capture(list(self._pending))

    def _before_part_load(self) -> None:
        # As Engine._before_part_load: the requests of this very update are taken before it.
        self.capture([q for q, (_, _, requested) in self._pending.items() if requested == self.version])

    def _capture(self, seq: int) -> None:
        staging, _, _ = self._pending.pop(seq)
        state = self._take()
        self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
        self._futures.append(self._writer.submit(self._write, staging, state))

    def _write(self, staging: str, state: Any) -> bool:
        written = write_share(staging, self._name, state)
        if not written:
            log.info("gockpt: checkpoint staging %s is gone (abandoned by its writer); %s not "
                     "written", staging, self._name)
        return written
