"""The README's options tables are generated from GoCkptConfig and GoCkptPlugin: never stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_options_tables_match_the_code():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_options_table.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_every_config_field_is_in_the_readme():
    from dataclasses import fields

    from gockpt import GoCkptConfig

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for f in fields(GoCkptConfig):
        assert f"| `{f.name}` |" in readme, f.name
