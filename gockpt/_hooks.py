"""Hooks the engine puts on the user's model and optimizers, safe to copy and to pickle.

A hook that is a bound method or a closure of the engine makes ``copy.deepcopy(model)`` (EMA and
SWA callbacks, user code) copy the whole engine with its threads and locks, and ``torch.save(model)``
fail. These hooks call back into the engine, but a copy or an unpickled module gets an inert
hook instead: the copy is not the tracked model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class InertHook:
    """What a copied or unpickled module holds in place of an :class:`EngineHook`."""

    def __call__(self, *_a: Any, **_k: Any) -> None:
        return None


class EngineHook:
    """Calls ``fn()`` (ignoring the hook's arguments; returns None, as every hook here must).

    Inert in a forked child: the engine's threads did not follow it there, so a hook that
    waited for them (a copy in flight) would wait forever."""

    __slots__ = ("fn", "pid")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.pid = os.getpid()

    def __call__(self, *_a: Any, **_k: Any) -> None:
        if os.getpid() == self.pid:
            self.fn()

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple:
        return (InertHook, ())


class StepPreHook(EngineHook):
    """An optimizer step pre-hook: calls ``fn()``; where the step is given a closure (the
    forward and backward then run inside ``step``: Lightning's automatic optimization, LBFGS),
    the closure is wrapped so that ``after_closure()`` runs when it first returns, right before
    the update, after every hook the closure calls (Lightning's ``on_before_optimizer_step`` of
    each callback and of the module, gradient clipping). A step given no closure calls
    ``without_closure()``, if any, after ``fn()``: where the window ended earlier (explicit
    mode), that pre-hook is the point right before the update (Lightning's mixed precision runs
    the closure before ``scaler.step``)."""

    __slots__ = ("after_closure", "without_closure")

    def __init__(self, fn: Callable[[], Any], after_closure: Callable[[], Any] | None,
                 without_closure: Callable[[], Any] | None = None) -> None:
        super().__init__(fn)
        self.after_closure = after_closure
        self.without_closure = without_closure

    def __call__(self, _opt: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if os.getpid() != self.pid:  # a forked child (see EngineHook)
            return None
        self.fn()
        if self.after_closure is None:  # an optimizer that may write weights before its closure
            return None
        if kwargs.get("closure") is not None:
            closure = kwargs["closure"]
        elif len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
            closure = args[1]
        else:
            if self.without_closure is not None:
                self.without_closure()
            return None
        after = self.after_closure
        first = [True]

        def wrapped(*a: Any, **k: Any) -> Any:
            out = closure(*a, **k)
            if first[0]:  # LBFGS calls it again between its own updates inside the step
                first[0] = False
                after()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs


def load_hooks(model: Any, optimizers: Any, whole: Callable[[], Any],
               part: Callable[[], Any]) -> list:
    """``load_state_dict`` pre-hooks: ``whole()`` before a load into ``model`` itself or one of
    ``optimizers`` (a restore, a rollback), ``part()`` before one into a submodule (a target
    network's sync, a refreshed teacher: an edit of the step). Returns the hook handles."""
    handles = [m.register_load_state_dict_pre_hook(EngineHook(whole if m is model else part))
               for m in model.modules()]
    handles += [o.register_load_state_dict_pre_hook(EngineHook(whole)) for o in optimizers]
    return handles
