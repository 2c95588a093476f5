"""``GOCKPT_ENABLED=1`` in the environment: GoCkpt attaches itself to every ``Accelerator``.

The line in ``gockpt-accelerate.pth`` (installed into site-packages with the package; editable
installs do not install it, use ``python -m accelerate_gockpt.run`` there) imports this module
at interpreter start-up only when ``GOCKPT_ENABLED`` is true. It imports neither torch nor
Accelerate: a meta-path finder waits until the script imports ``accelerate.accelerator`` and
then wraps ``Accelerator.prepare`` (:func:`accelerate_gockpt.run.install`), so an unchanged
script started by ``GOCKPT_ENABLED=1 accelerate launch train.py`` (which passes the environment
to every process) runs with GoCkpt. Accelerate's config file rejects unknown keys and has no
plugin registry: the environment is the place.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

TRUE_WORDS = ("1", "true", "yes", "y", "on", "t")  # as gockpt.env reads booleans


def enabled(environ: Any = os.environ) -> bool:
    """Whether ``GOCKPT_ENABLED`` asks for GoCkpt."""
    return environ.get("GOCKPT_ENABLED", "").strip().lower() in TRUE_WORDS


class _AcceleratorFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``accelerate.accelerator`` once."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "accelerate.accelerator":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module: Any) -> None:
            exec_module(module)
            from accelerate_gockpt.run import install  # accelerate.accelerator is loaded now

            install(module.Accelerator)

        spec.loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


def activate() -> None:
    """Install the finder (idempotent); wrap ``Accelerator`` now if Accelerate is already loaded."""
    module = sys.modules.get("accelerate.accelerator")
    if module is not None:
        from accelerate_gockpt.run import install

        install(module.Accelerator)
    elif not any(isinstance(f, _AcceleratorFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AcceleratorFinder())


if enabled():
    activate()
