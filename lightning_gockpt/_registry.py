"""The GoCkpt callbacks set up in this process, for loads through any ``GoCkptIO``.

A load finishes the saves of its path that another Trainer's engine has in flight (an
evaluation Trainer made inside a fit's callback: :meth:`GoCkptCallback.wait_for`). Held weakly;
the lock: a Trainer set up on another thread must not change the set while a load lists it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()


def register(callback: Any) -> None:
    """Note ``callback`` (a ``GoCkptCallback`` at its ``setup``)."""
    with _LOCK:
        _LIVE.add(callback)


def live_callbacks() -> list[Any]:
    """The callbacks noted in this process that are still alive."""
    with _LOCK:
        return list(_LIVE)
