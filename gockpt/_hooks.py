"""Hooks the engine puts on the user's model and optimizers, safe to copy and to pickle.

A hook that is a bound method or a closure of the engine makes ``copy.deepcopy(model)`` (EMA and
SWA callbacks, user code) copy the whole engine with its threads and locks, and ``torch.save(model)``
fail. These hooks call back into the engine, but a copy or an unpickled module gets an inert
hook instead: the copy is not the tracked model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class InertHook:
    """What a copied or unpickled module holds in place of an :class:`EngineHook`."""

    def __call__(self, *_a: Any, **_k: Any) -> None:
        return None


class EngineHook:
    """Calls ``fn()`` (ignoring the hook's arguments; returns None, as every hook here must)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self, *_a: Any, **_k: Any) -> None:
        self.fn()

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple:
        return (InertHook, ())
