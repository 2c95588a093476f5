"""``python -m gockpt``: the ``gockpt`` command line (:mod:`gockpt.cli`)."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
