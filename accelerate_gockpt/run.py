"""Run an unchanged Accelerate script with GoCkpt attached at ``prepare``.

::

    accelerate launch -m accelerate_gockpt.run train.py --its --own --arguments
    python -m accelerate_gockpt.run train.py ...

Every ``Accelerator`` of the script gets GoCkpt (options from ``GOCKPT_*`` variables or
``GOCKPT_CONFIG_FILE``; ``GOCKPT_ENABLED=0`` leaves Accelerate's own ``save_state``) as soon as a
``prepare`` call has left it a model and an optimizer; models prepared later (after
``free_memory()``) are followed at the next ``save_state``. With the package installed from a
wheel, ``GOCKPT_ENABLED=1 accelerate launch train.py`` does the same without the ``-m``
(``_gockpt_autoattach``, started from a ``.pth`` file; not in editable installs).
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from accelerate.accelerator import Accelerator  # not `from accelerate`: may run inside its import

from .checkpointer import GoCkptCheckpointer
from .plugin import GoCkptPlugin, attach


def install(cls: type = Accelerator) -> None:
    """Make every ``cls.prepare`` of this process attach GoCkpt once it can (idempotent).

    The checkpointer attached this way is marked ``automatic``: an explicit :func:`attach`
    in the script replaces it with its own options.
    """
    original = cls.prepare
    if getattr(original, "_gockpt_installed", False):
        return

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        attached = isinstance(getattr(self.save_state, "__self__", None), GoCkptCheckpointer)
        if not attached and self._models and self._optimizers:
            ckpt = attach(self, GoCkptPlugin())
            if ckpt is not None:
                ckpt.automatic = True
        return out

    prepare._gockpt_installed = True  # type: ignore[attr-defined]
    cls.prepare = prepare  # type: ignore[method-assign]


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
