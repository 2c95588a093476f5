"""Every scalar :class:`gockpt.GoCkptConfig` option as a field of a framework's plugin.

A framework adapter offers GoCkpt's options in its own style (Accelerate's plugins are
dataclasses). :func:`engine_options` makes the base of such a class: one optional field per
scalar engine option (same name and meaning; None: unset), generated from
:class:`~gockpt.GoCkptConfig` so none can drift, and :meth:`EngineOptions.resolve`, which fills
every field left None from ``GOCKPT_<FIELD>``, then the config file, then the plugin's
defaults, and validates, naming where a bad value came from (:mod:`gockpt.env`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field, make_dataclass
from typing import Any, ClassVar

from . import env as _env
from .config import GoCkptConfig

__all__ = ["EngineOptions", "engine_options"]


class EngineOptions:
    """Base of the class :func:`engine_options` makes (a kw-only dataclass).

    A subclass may declare fields of its own (``bool``/``int``/``float``/``str``, default
    None: read from ``GOCKPT_<FIELD>`` too) and a ``config_file`` field (the YAML or JSON file
    of defaults; ``GOCKPT_CONFIG_FILE`` when None).
    """

    engine_kinds: ClassVar[dict[str, type]] = {}
    """Engine option -> its kind (``bool``, ``int``, ``float`` or ``str``)."""

    config_file: str | None

    def resolve(self, defaults: Mapping[str, Any],
                check: Callable[[], None] = lambda: None) -> None:
        """Fill every option left None: argument, then ``GOCKPT_<OPTION>``, then the config
        file, then ``defaults`` (else it stays None: the engine's default); then validate.

        Args:
            defaults: the subclass's own fields' defaults.
            check: raises ``ValueError`` for an out-of-range own field (naming it); the
                engine's fields are checked by :class:`~gockpt.GoCkptConfig`.

        Raises:
            ValueError: a value that does not parse or is out of range, naming the field and
                the variable or file it came from; an unknown key in the config file.
            FileNotFoundError: the config file does not exist.
        """
        if self.config_file is None:
            self.config_file = os.environ.get(_env.CONFIG_FILE_ENV) or None
        own = _env.option_kinds(type(self), exclude=[*self.engine_kinds, "config_file"])
        sources = _env.fill_unset(self, {**self.engine_kinds, **own}, self.config_file)
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        try:
            check()
            self.to_config()  # range checks of the engine's fields, naming the field
        except ValueError as e:
            raise _env.name_source(e, sources) from None

    def to_config(self) -> GoCkptConfig:
        """The engine configuration these options describe (a subclass may fix fields).

        Raises:
            ValueError: a value out of range, naming the field.
        """
        return self.engine_config()

    def engine_config(self, **fixed: Any) -> GoCkptConfig:
        """The engine configuration of the options set, with ``fixed`` fields on top.

        Raises:
            ValueError: a value out of range, naming the field.
        """
        kwargs = {name: getattr(self, name) for name in self.engine_kinds
                  if getattr(self, name) is not None}
        return GoCkptConfig(**{**kwargs, **fixed})


def engine_options(exclude: Iterable[str] = ()) -> type:
    """A kw-only dataclass, subclass of :class:`EngineOptions`, with a field ``<name>: kind |
    None = None`` for every scalar :class:`~gockpt.GoCkptConfig` field not in ``exclude``."""
    kinds = _env.option_kinds(GoCkptConfig, exclude=exclude)
    return make_dataclass(
        "EngineOptionsFields",
        [(name, kind | None, field(default=None)) for name, kind in kinds.items()],
        bases=(EngineOptions,), namespace={"engine_kinds": kinds}, kw_only=True)
