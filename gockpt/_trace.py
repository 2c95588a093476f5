"""Opt-in timeline of the engine's background work: per thread, per phase, wall and CPU time.

Off unless :func:`start` was called: each instrumented phase then costs one attribute check.
The benchmark (``examples/benchmark.py``) turns it on to see which background phase (copy,
replay, serialize, write, checksum, fsync, publish) overlaps the training steps that a
checkpoint slows. Phases run outside the GIL where the library call releases it
(``Tensor.copy_``, torch optimizer kernels, ``xxhash`` updates, file writes, ``fsync``); a
thread's CPU time *between* its phases is Python that holds the GIL.
"""

from __future__ import annotations

import contextlib
import threading
import time
from time import perf_counter
from typing import NamedTuple


class Event(NamedTuple):
    """One phase on one thread.

    Attributes:
        thread: the thread's name (``gockpt-copy``, ``gockpt-replay``, ``gockpt-persist_0``,
            ``gockpt-io_2``, ...).
        phase: ``copy``, ``replay``, ``serialize``, ``write``, ``checksum``, ``fsync``,
            ``manifest``, ``publish`` or ``latest``.
        start, end: ``perf_counter()`` seconds.
        cpu_start, cpu_end: the thread's ``time.thread_time()`` seconds.
        nbytes: bytes the phase moved (0 where none).
        ident: ``threading.get_ident()`` of the thread (names repeat across thread pools).
    """

    thread: str
    phase: str
    start: float
    end: float
    cpu_start: float
    cpu_end: float
    nbytes: int
    ident: int


_events: list[Event] | None = None


def start() -> None:
    """Start recording (drops what an earlier recording held)."""
    global _events
    _events = []


def stop() -> list[Event]:
    """Stop recording and return the events in the order their phases ended."""
    global _events
    events, _events = _events or [], None
    return events


def active() -> bool:
    """Whether a recording is on."""
    return _events is not None


class _Phase:
    __slots__ = ("events", "name", "nbytes", "t0", "c0")

    def __init__(self, events: list[Event], name: str, nbytes: int) -> None:
        self.events, self.name, self.nbytes = events, name, nbytes

    def __enter__(self) -> None:
        self.t0, self.c0 = perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.events.append(Event(threading.current_thread().name, self.name, self.t0,
                                 perf_counter(), self.c0, time.thread_time(), self.nbytes,
                                 threading.get_ident()))


_OFF = contextlib.nullcontext()


def phase(name: str, nbytes: int = 0) -> contextlib.AbstractContextManager[None]:
    """A context that records ``name`` on the calling thread while recording is on (a shared
    no-op context otherwise). ``nbytes``: bytes the phase moves."""
    events = _events
    return _OFF if events is None else _Phase(events, name, nbytes)
