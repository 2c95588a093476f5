"""Finish checkpoints in flight when a process ends without closing its engine.

A run can end without ``close()``: an exception escaping a ``ddp_spawn`` worker (Lightning calls
no hook there), a script whose last call is a save. Saves already requested must still become
durable (or be cleaned up), and bookkeeping that waits on them (top-k removals) must still run.

The hooks run when the interpreter shuts down, *before* ``concurrent.futures`` joins its worker
threads and refuses new work (the persist pool is one): ``threading._register_atexit`` hooks run
in reverse order of registration, and ``concurrent.futures`` registers its own at import, before
any of ours. Where that function is missing, plain ``atexit`` is used (the hook then runs after
the pools were shut down; saves still queued fail cleanly instead of completing).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger("gockpt")

_HOOKS: list[tuple[int, weakref.WeakMethod]] = []
_LOCK = threading.Lock()
_REGISTERED = False
_COUNTER = 0
#: True once the interpreter runs these hooks (the process is ending).
EXITING = False


def stopped_by_exception() -> bool:
    """Whether an exception is propagating now (a ``finally``, ``__exit__``, an exception
    handler), or the process is ending after an uncaught one: where a training loop may have
    stopped midway through a step."""
    if sys.exc_info()[0] is not None:
        return True
    return EXITING and getattr(sys, "last_value", getattr(sys, "last_exc", None)) is not None


def _run_hooks() -> None:
    global EXITING
    EXITING = True
    with _LOCK:
        hooks = list(reversed(_HOOKS))  # the newest first: an adapter before its engine
        _HOOKS.clear()
    for _, ref in hooks:
        fn = ref()
        if fn is None:
            continue
        try:
            fn()
        except BaseException:  # noqa: BLE001 - the process is ending; report and go on
            log.exception("gockpt: finishing checkpoints at exit failed")


def register(method: Any) -> int:
    """Call the bound ``method`` at interpreter exit, unless :func:`unregister`-ed first.

    Holds only a weak reference: an object collected before exit is not called.

    Returns:
        A token for :func:`unregister`.
    """
    global _REGISTERED, _COUNTER
    with _LOCK:
        if not _REGISTERED:
            hook = getattr(threading, "_register_atexit", None)
            try:
                if hook is None:
                    raise RuntimeError
                hook(_run_hooks)
            except RuntimeError:  # missing, or already shutting down
                atexit.register(_run_hooks)
            _REGISTERED = True
        _COUNTER += 1
        _HOOKS.append((_COUNTER, weakref.WeakMethod(method)))
        return _COUNTER


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) must not finish its parent's engines.
    _HOOKS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def unregister(token: int) -> None:
    """Forget the hook registered under ``token`` (idempotent)."""
    with _LOCK:
        _HOOKS[:] = [(t, ref) for t, ref in _HOOKS if t != token]
