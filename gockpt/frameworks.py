"""Framework formats: the seam through which adapter packages give the engine their conversions.

A training framework's checkpoint format needs the framework's own code (Lightning's dict read
from or saved as a GoCkpt checkpoint through ``GoCkptIO``, its single ``.ckpt`` file). The adapter
package provides that code as a :class:`Framework` under the entry point group
:data:`FRAMEWORKS_GROUP`; :mod:`gockpt.convert` and :mod:`gockpt.cli` look it up by name with
:func:`get_framework` when a conversion needs it. So this framework-free package imports no
adapter (the dependency points one way: adapters import the engine), and a conversion that needs
a framework which is not installed fails naming what to install. :func:`register_framework`
registers one in code. The names are also importable from :mod:`gockpt.convert`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FRAMEWORKS_GROUP",
    "Framework",
    "FrameworkUnavailableError",
    "get_framework",
    "register_framework",
]

#: The entry point group whose entries name a :class:`Framework`: in an adapter's
#: ``pyproject.toml``, ``[project.entry-points."gockpt.frameworks"] NAME = "pkg.module:OBJECT"``.
FRAMEWORKS_GROUP = "gockpt.frameworks"


@dataclass(frozen=True)
class Framework:
    """A training framework's checkpoint format, converted by the framework's own code.

    The adapter package provides one (Lightning: ``lightning_gockpt.convert:FRAMEWORK``) through
    the entry point group :data:`FRAMEWORKS_GROUP`, or in code by :func:`register_framework`;
    :func:`get_framework` finds it. The functions take keyword arguments as listed.

    Attributes:
        name: the registry key and ``gockpt convert --to`` target (``"lightning"``).
        load_gockpt: ``(path, *, storage_options, allow_pickle, verify) -> dict``: the
            framework's checkpoint dict of a GoCkpt checkpoint its adapter wrote.
        save_gockpt: ``(checkpoint, dst, *, storage_options, max_shard_bytes) -> None``: the
            framework's checkpoint dict (e.g. a stock file loaded) saved as a GoCkpt checkpoint.
        to_file: ``(source, dst, *, storage_options) -> int``: a
            :class:`gockpt.convert.Source` written as the framework's own single checkpoint
            file; returns the file's size in bytes.
    """

    name: str
    load_gockpt: Callable[..., dict[str, Any]]
    save_gockpt: Callable[..., None]
    to_file: Callable[..., int]


class FrameworkUnavailableError(ModuleNotFoundError):
    """A conversion needs a :class:`Framework` that is not registered or does not import.

    A ``ModuleNotFoundError``, as the missing import was before frameworks were plugins, so
    ``except ModuleNotFoundError`` still catches it. ``name`` is the module that failed to import
    (``"lightning"``), or the framework's name when none is registered under it.
    """


# Frameworks registered in code, and entry points already loaded (loaded once: the import is
# the adapter's whole package, and a second load would give the same object).
_frameworks: dict[str, Framework] = {}


def register_framework(framework: Framework) -> None:
    """Register ``framework`` under its name, ahead of an entry point of the same name.

    For frameworks not installed as a distribution (tests, a script's own format).

    Raises:
        TypeError: ``framework`` is not a :class:`Framework`.
    """
    if not isinstance(framework, Framework):
        raise TypeError(f"register_framework takes a gockpt.convert.Framework, "
                        f"not {type(framework).__name__}")
    _frameworks[framework.name] = framework


def get_framework(name: str, *, needed_for: str = "") -> Framework:
    """The :class:`Framework` called ``name``.

    One given to :func:`register_framework`, else the entry point ``name`` of the group
    :data:`FRAMEWORKS_GROUP`, imported on this first use (so the framework's package is
    imported only by a conversion that needs it).

    Args:
        name: the framework's name, e.g. ``"lightning"``.
        needed_for: what needs it, to begin the error message (``"<path>: a Lightning
            checkpoint"``).

    Returns:
        The framework.

    Raises:
        FrameworkUnavailableError: no framework of that name is registered, or its entry point
            does not import (the framework's package is not installed); the import error is the
            ``__cause__``.
        TypeError: the entry point names something other than a :class:`Framework` called
            ``name``.
    """
    found = _frameworks.get(name)
    if found is not None:
        return found
    what = f"{needed_for}: " if needed_for else ""
    # The first distribution on sys.path that declares the name wins, as for console scripts.
    entry = next(iter(importlib.metadata.entry_points(group=FRAMEWORKS_GROUP, name=name)), None)
    if entry is None:
        raise FrameworkUnavailableError(
            f"{what}install {name} to convert it (no {name!r} framework in the entry point "
            f"group {FRAMEWORKS_GROUP!r}; reinstall gockpt if it was installed from source)",
            name=name)
    try:
        loaded = entry.load()
    except ImportError as e:
        raise FrameworkUnavailableError(
            f"{what}install {name} to convert it ({entry.value} does not import: {e})",
            name=e.name or name) from e
    if not isinstance(loaded, Framework) or loaded.name != name:
        raise TypeError(f"entry point {name} = {entry.value} of {FRAMEWORKS_GROUP!r} is not a "
                        f"gockpt.convert.Framework named {name!r}")
    return _frameworks.setdefault(name, loaded)
