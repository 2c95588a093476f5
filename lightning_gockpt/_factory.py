"""Entry point of the group ``lightning.pytorch.callbacks_factory``: one inert callback per Trainer."""

from __future__ import annotations


def callbacks_factory() -> list:
    """Returns the callback half of :class:`lightning_gockpt.GoCkptIO` for every new ``Trainer``.

    It stays inert unless the Trainer's ``strategy.checkpoint_io`` is a ``GoCkptIO``.
    """
    from .callback import GoCkptCallback

    return [GoCkptCallback(_from_factory=True)]
