"""The share of a checkpoint that processes other than the main one write.

Under Accelerate's roles the main process writes model, optimizer, schedulers and registered
objects; every process writes its own ``random_states_<rank>.pkl``. Only the main process runs
the engine (the model and optimizer are replicas), so the others need the step at which the
main process's checkpoint is captured. They count optimizer updates with the same step
post-hooks the engine uses and take their RNG state at the same step boundaries:

1. (training thread, ``save_state`` on every process) the main process broadcasts the
   checkpoint's staging folder, its captured step (the target) and which earlier checkpoints it
   captured during this call (a flush when no snapshot slot was free).
2. (training thread, first boundary at the target: ``accumulate()``, the model's forward
   pre-hook, an optimizer step pre-hook, ``save_state``) take this process's RNG state.
3. (writer thread) write ``random_states_<rank>.pkl`` into the staging folder atomically; the
   main process publishes the folder once every rank's file is there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import nn
from torch.optim import Optimizer

from ._publish import write_rank_file

log = logging.getLogger("accelerate_gockpt")


class RankCapture:
    """Takes this process's per-rank state at the main process's captured steps.

    Args:
        models: the unwrapped models (forward pre-hooks mark step boundaries).
        optimizers: the inner torch optimizers (post-hooks count updates as the engine does).
        take: returns the per-rank state (``random_states_<rank>.pkl`` content).
        rank: this process's index.
    """

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer],
                 take: Callable[[], dict[str, Any]], rank: int) -> None:
        self.version = 0
        self._take = take
        self._rank = rank
        self._pending: dict[int, tuple[str, int]] = {}
        self._futures: list[Future[bool]] = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gockpt-accelerate-rank")
        self._hooks = []
        for o in optimizers:
            self._hooks.append(o.register_step_post_hook(lambda *_a: self._on_update()))
            self._hooks.append(o.register_step_pre_hook(lambda *_a: self.boundary()))
        for m in models:
            self._hooks.append(m.register_forward_pre_hook(lambda *_a: self.boundary()))

    def add(self, seq: int, staging: str, target: int) -> None:
        """Register checkpoint ``seq`` of the main process, captured at update ``target``."""
        self._pending[seq] = (staging, target)

    def boundary(self) -> None:
        """A step boundary: take the state of checkpoints whose target is the current update."""
        for seq, (_, target) in list(self._pending.items()):
            if target == self.version:
                self._capture(seq)

    def capture(self, seqs: Sequence[int]) -> None:
        """Take the state of checkpoints ``seqs`` now (the main process captured them here)."""
        for seq in seqs:
            if seq in self._pending:
                self._capture(seq)

    def check(self) -> None:
        """Re-raise the first failed write on the calling (training) thread."""
        for f in self._futures:
            if f.done() and f.exception() is not None:
                self._futures.remove(f)
                raise RuntimeError("gockpt: writing this process's checkpoint state failed") from f.exception()

    def wait(self, timeout_s: float | None = None) -> None:
        """Take every pending checkpoint's state now and block until written.

        Call where the main process flushes (``wait``/``close``/``load_state`` on every process).

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

    def _capture(self, seq: int) -> None:
        staging, _ = self._pending.pop(seq)
        state = self._take()
        self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
        self._futures.append(self._writer.submit(self._write, staging, state))

    def _write(self, staging: str, state: dict[str, Any]) -> bool:
        written = write_rank_file(staging, self._rank, state)
        if not written:
            log.info("gockpt: rank %d: checkpoint staging %s is gone (abandoned by the main "
                     "process); state not written", self._rank, staging)
        return written
