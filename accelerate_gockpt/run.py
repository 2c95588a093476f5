"""Run an unchanged Accelerate script with GoCkpt attached at ``prepare``.

::

    accelerate launch -m accelerate_gockpt.run train.py --its --own --arguments
    python -m accelerate_gockpt.run train.py ...

Every ``Accelerator`` of the script gets GoCkpt (options from ``GOCKPT_*`` variables or
``GOCKPT_CONFIG_FILE``; ``GOCKPT_ENABLED=0`` leaves Accelerate's own ``save_state``) as soon as a
``prepare`` call has left it a model and an optimizer; models prepared later (after
``free_memory()``) are followed at the next ``save_state``. Accelerate's config file rejects
unknown keys and has no plugin registry, so the launch command is where this is switched on.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from accelerate import Accelerator

from .checkpointer import GoCkptCheckpointer
from .plugin import GoCkptPlugin, attach

_ORIGINAL_PREPARE = Accelerator.prepare


def install() -> None:
    """Make every ``Accelerator.prepare`` of this process attach GoCkpt once it can (idempotent)."""
    if Accelerator.prepare is not _ORIGINAL_PREPARE:
        return

    def prepare(self: Accelerator, *args: Any, **kwargs: Any) -> Any:
        out = _ORIGINAL_PREPARE(self, *args, **kwargs)
        attached = isinstance(getattr(self.save_state, "__self__", None), GoCkptCheckpointer)
        if not attached and self._models and self._optimizers:
            attach(self, GoCkptPlugin())
        return out

    Accelerator.prepare = prepare  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    """``python -m accelerate_gockpt.run SCRIPT [ARGS...]``: run SCRIPT as ``__main__``."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    install()
    sys.argv = list(args)
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
