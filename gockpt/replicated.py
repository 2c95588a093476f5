"""Checkpoints of a replicated run: one process writes, every process adds its share.

With replicated training (DDP, Accelerate's multi-process runs) the model and optimizer state
are the same on every process, so one process (the writer) runs the :class:`gockpt.Engine`;
each other process runs a :class:`gockpt.ranks.RankCapture` for the state only it holds (its
RNG, ...), taken at the writer's captured step. :class:`ReplicatedEngine` drives both through
one interface, so an adapter calls the same methods on every process. Call sequence of one
``save`` (every process, at the same step boundary):

1. (writer, training thread) ``prepare()`` makes the staging directory and the
   :class:`~gockpt.writer.CheckpointWriter`; the engine takes the request
   (:meth:`gockpt.Engine.save`).
2. (all) the writer's descriptor is broadcast (:func:`gockpt.ranks.exchange_request`); an error
   on the writer is raised on every process.
3. (others) the share is taken at the captured step and written into the staging directory;
   the writer's ``before_publish`` waits for it (:func:`gockpt.ranks.wait_for_shares`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

from torch import nn
from torch.optim import Optimizer

from ._hooks import EngineHook
from .config import GoCkptConfig
from .engine import Engine
from .handle import CheckpointMetrics, SaveHandle
from .ranks import RankCapture, describe_request, exchange_request
from .writer import CheckpointWriter

__all__ = ["ReplicatedEngine"]

log = logging.getLogger("gockpt")


class ReplicatedEngine:
    """An :class:`~gockpt.Engine` on the writing process, a share taker on every other one.

    Args:
        model: the module the engine checkpoints (writer only).
        optimizers: the torch optimizers (their step hooks count updates on every process).
        config: engine options.
        is_writer: whether this process writes the checkpoint.
        share: on the others, returns this process's share (any ``torch.save``-able object, or
            the file's bytes).
        share_name: its file name in the staging directory (e.g. one per rank).
        broadcast: sends the writer's object to every process and returns it; None with one
            process.
        boundary_modules: modules whose forward starts a step (several models whose container
            is never called); their forward pre-hooks mark step boundaries.

    Attributes:
        engine: the engine (writer; else None).
        metrics: metrics of every checkpoint published so far (writer), in publish order.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[Optimizer], config: GoCkptConfig, *,
                 is_writer: bool, share: Callable[[], Any] | None = None, share_name: str = "",
                 broadcast: Callable[[Any], Any] | None = None,
                 boundary_modules: Sequence[nn.Module] = ()) -> None:
        self.engine: Engine | None = None
        self._capture: RankCapture | None = None
        self.metrics: list[CheckpointMetrics] = []
        self._broadcast = broadcast
        self._pending: list[tuple[int, SaveHandle]] = []  # (request number, handle)
        self._finished: list[CheckpointMetrics] = []  # since the last wait()
        self._taken = 0  # self.metrics[:_taken] were returned by take_published()
        self._seq = 0
        self._hooks: list = []
        if is_writer:
            self.engine = Engine(model, list(optimizers), config)
            self._hooks = [m.register_forward_pre_hook(EngineHook(self.boundary)) for m in boundary_modules]
        else:
            assert share is not None and share_name, "a share and its file name"
            self._capture = RankCapture(boundary_modules or [model], optimizers, share, share_name,
                                        model=model)

    @property
    def saves(self) -> list[SaveHandle]:
        """Handles of the writer's requests not yet finished (or not yet seen finished), oldest first."""
        return [h for _, h in self._pending]

    def save(self, path: str, prepare: Callable[[], tuple[str, CheckpointWriter]], *,
             exact_step: bool = False, state_fn: Callable[[], Any] | None = None) -> SaveHandle | None:
        """Request a checkpoint at ``path``; call on every process at the same step boundary.

        Args:
            path: the checkpoint directory.
            prepare: (writer only) makes the staging directory and returns it with the
                checkpoint's writer; the staging directory is deleted when the save ends
                without publishing.
            exact_step, state_fn: as :meth:`gockpt.Engine.save` (writer only).

        Returns:
            The engine's handle on the writer; None elsewhere.

        Raises:
            What ``prepare`` or the engine raised on the writer, on every process (the
            others get a ``RuntimeError`` naming it). With mode ``sync`` and several
            processes, the save is persisted in the background and waited for after the
            exchange (its metrics name mode ``async``, the wait counted as ``persist`` stall),
            and what its persist raised is raised on every process in the same way.
        """
        handle = None
        # A blocking save (mode "sync") would persist inside engine.save, and its publish waits
        # for the other processes' shares, which they write only after the exchange below: it
        # is requested as "async" (the same copy at the same step, persisted in the background)
        # and waited for once the others have its descriptor.
        blocking = (self.engine is not None and self._broadcast is not None
                    and self.engine.config.mode == "sync")
        if self.engine is not None:
            seq, self._seq = self._seq, self._seq + 1
            staging = None
            try:
                # A folder in flight that holds this one is published first: the staging
                # folder made next would be inside it (Engine.finish_enclosing). Not with
                # other processes: that publish waits for their shares, which they write only
                # after this request's exchange; the request is refused instead, on every
                # process, and the enclosing save goes on.
                if self._broadcast is None:
                    self.engine.finish_enclosing(path)
                elif enclosing := self.engine.enclosing_in_flight(path):
                    raise ValueError(
                        f"{path}: inside the folder of checkpoint {enclosing[0]}, still being "
                        "written; with several processes it must be complete first (wait for "
                        "it, e.g. the plugin's wait(), before saving inside it)")
                staging, writer = prepare()
                waiting = [(q, h) for q, h in self._pending if h.captured_step is None]
                handle = self.engine.save(path, exact_step=exact_step, writer=writer, state_fn=state_fn,
                                          mode="async" if blocking else None)
            except BaseException as e:  # noqa: BLE001 - every process raises it after the broadcast
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                desc = describe_request(seq, error=e)
            else:
                handle.add_done_callback(lambda h: self._on_done(h, staging))
                self._pending.append((seq, handle))
                desc = describe_request(seq, staging, handle, waiting, version=self.engine.version)
                desc["blocking"] = blocking
        else:
            assert self._capture is not None
            self._capture.boundary()  # the writer's engine.save() is a boundary as well
            desc = None
        desc = exchange_request(desc, self._broadcast)
        if self._capture is not None:
            self._capture.follow(desc)
        if desc.get("blocking"):
            # Durable (or failed) before save returns on every process, as sync promises; its
            # outcome is exchanged too, so a failed persist is raised everywhere, not on the
            # writer alone (the others would go on into a collective it never joins).
            outcome = None
            if handle is not None:
                t0 = perf_counter()
                try:
                    handle.result()
                except BaseException as e:  # noqa: BLE001 - raised on every process below
                    outcome = describe_request(desc["seq"], error=e)
                else:
                    handle.metrics.add_stall("persist", perf_counter() - t0)
                    outcome = describe_request(desc["seq"])
            exchange_request(outcome, self._broadcast)
        self._harvest()
        return handle

    @property
    def version(self) -> int:
        """Optimizer updates seen by this process's engine (or capture)."""
        if self.engine is not None:
            return self.engine.version
        return self._capture.version if self._capture is not None else 0

    @property
    def capture_pending(self) -> bool:
        """Whether a save of this process is still to take its state (not yet captured)."""
        if self.engine is not None:
            return any(h.captured_step is None and not h.done() for h in self.saves)
        return self._capture is not None and self._capture.pending

    def boundary(self) -> None:
        """A step boundary no hook sees (e.g. the start of an accumulation context)."""
        if self.engine is not None:
            self.engine.step_end()
        elif self._capture is not None:
            self._capture.boundary()

    def wait(self, timeout_s: float | None = None) -> list[CheckpointMetrics]:
        """Finish every pending checkpoint now (captured at the current step) and block until
        published; call on every process at the same point.

        Returns:
            Metrics of the checkpoints finished since the last wait, skipped ones included
            (writer; else empty).

        Raises:
            The first background error; TimeoutError after ``timeout_s`` seconds.
        """
        if self.engine is not None:
            self.engine.wait(timeout_s)
            for h in self.saves:
                try:
                    h.result(timeout_s)
                except TimeoutError:
                    raise
                except BaseException:  # noqa: BLE001 - the engine raised it once, above
                    pass
        self._harvest()
        out, self._finished = self._finished, []
        if self._capture is not None:
            self._capture.wait(timeout_s)
        return out

    def take_published(self) -> list[CheckpointMetrics]:
        """Metrics of checkpoints published since the last call (for loggers, training thread)."""
        self._harvest()
        new, self._taken = self.metrics[self._taken:], len(self.metrics)
        return new

    def close(self) -> None:
        """:meth:`wait`, then stop the engine or share taker and remove the hooks."""
        try:
            if self.engine is not None:
                self.engine.close()
            if self._capture is not None:
                self._capture.close()
        finally:
            self._harvest()
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def _on_done(self, handle: SaveHandle, staging: str) -> None:
        # Any thread. A save that published nothing (skipped, superseded, failed) leaves no
        # staging behind; a published one's was renamed into place.
        shutil.rmtree(staging, ignore_errors=True)
        try:
            m = handle.result(0)
        except BaseException:  # noqa: BLE001 - the engine raises it on the training thread
            return
        if not m.skipped and not m.superseded:
            log.info("gockpt: published %s (captured step %s, stall %.4f s)", m.path,
                     m.captured_step, m.stall_s)

    def _harvest(self) -> None:
        # Training thread: move finished saves out of the pending list; published ones into metrics.
        for item in [item for item in self._pending if item[1].done()]:
            self._pending.remove(item)
            try:
                m = item[1].outcome(0)
            except BaseException:  # noqa: BLE001 - the engine raises it on the training thread
                continue
            self._finished.append(m)
            if not m.skipped and not m.superseded:
                self.metrics.append(m)
