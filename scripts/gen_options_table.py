"""Generate the README's options tables from the code, so they cannot drift from it.

- GoCkptConfig: every field of ``gockpt.config.GoCkptConfig`` with its default, its unit (from
  the field's name: ``*_bytes``, ``*_s``, ...), the first sentence of its docstring, and its
  ``GOCKPT_*`` variable when ``accelerate_gockpt.GoCkptPlugin`` reads one for it (every field
  but the plugin's ``_NOT_OPTIONS``);
- GoCkptPlugin: the Accelerate plugin's own fields (their ``help`` metadata).

Both files are read as source (``ast``), so neither torch nor accelerate is imported.

    python scripts/gen_options_table.py          # rewrite the tables in README.md
    python scripts/gen_options_table.py --check  # exit 1 if README.md is out of date
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIG = ROOT / "gockpt" / "config.py"
PLUGIN = ROOT / "accelerate_gockpt" / "plugin.py"
ENV_PREFIX = "GOCKPT_"  # gockpt.env.ENV_PREFIX
MARKERS = {
    "config": ("<!-- options-table:start -->", "<!-- options-table:end -->"),
    "plugin": ("<!-- accelerate-options-table:start -->", "<!-- accelerate-options-table:end -->"),
}


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def config_fields() -> list[dict]:
    """Name, default (source text), docstring of every GoCkptConfig field, in order."""
    body = _class(CONFIG, "GoCkptConfig").body
    out = []
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else ""
        out.append({"name": node.target.id, "default": _default(node.value), "doc": str(doc)})
    return out


def plugin_fields() -> dict[str, str]:
    """GoCkptPlugin field -> its help text."""
    out = {}
    for node in _class(PLUGIN, "GoCkptPlugin").body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            help_text = ""
            if isinstance(node.value, ast.Call):
                for kw in node.value.keywords:
                    if kw.arg == "metadata":
                        help_text = ast.literal_eval(kw.value).get("help", "")
            out[node.target.id] = help_text
    return out


def _default(node: ast.expr | None) -> str:
    if node is None:
        return "required"
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":
        for kw in node.keywords:
            if kw.arg == "default_factory":
                return {"dict": "{}", "list": "[]"}.get(getattr(kw.value, "id", ""), "...")
            if kw.arg == "default":
                return _default(kw.value)
    try:
        value = eval(compile(ast.Expression(node), "<default>", "eval"), {})  # constants only
    except Exception:  # noqa: BLE001 - shown as written
        return ast.unparse(node)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value >> 20} MiB"
    return repr(value) if isinstance(value, str) else str(value)


def _unit(name: str) -> str:
    for suffix, unit in (("_bytes_per_s", "bytes/s"), ("_bytes", "bytes"), ("_s", "seconds"),
                         ("_steps", "optimizer steps")):
        if name.endswith(suffix):
            return unit
    if name.startswith("num_"):
        return "count"
    return {"max_inflight": "checkpoints"}.get(name, "")


def _text(doc: str, sentences: int = 1) -> str:
    """The first sentence(s) of an RST docstring, as one line of Markdown."""
    text = " ".join(doc.split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)  # :class:`x` -> `x`
    text = text.replace("``", "`").replace("|", "\\|")
    parts = re.split(r"(?<=[.)])\s+(?=[A-Z`(])", text)
    return " ".join(parts[:sentences])


def plugin_excluded() -> set[str]:
    """GoCkptConfig fields the plugin does not offer (its ``_NOT_OPTIONS``)."""
    tree = ast.parse(PLUGIN.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_NOT_OPTIONS" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def config_table() -> str:
    env_fields = {f["name"] for f in config_fields()} - plugin_excluded()
    rows = ["| option | environment | default | unit | meaning |", "|---|---|---|---|---|"]
    for f in config_fields():
        env = f"`{ENV_PREFIX}{f['name'].upper()}`" if f["name"] in env_fields else "-"
        rows.append(f"| `{f['name']}` | {env} | `{f['default']}` | {_unit(f['name']) or '-'} | "
                    f"{_text(f['doc'], 2)} |")
    return "\n".join(rows)


def plugin_table() -> str:
    config = {f["name"] for f in config_fields()}
    rows = ["| option | environment | meaning |", "|---|---|---|"]
    for name, help_text in plugin_fields().items():
        if name in config:
            continue
        rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {_text(help_text, 3)} |")
    return "\n".join(rows)


def render(readme: str) -> str:
    """``readme`` with both tables replaced by freshly generated ones."""
    for key, table in (("config", config_table()), ("plugin", plugin_table())):
        start, end = MARKERS[key]
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md lacks the markers {start} ... {end}")
        readme = pattern.sub(lambda _m, s=start, e=end, t=table: f"{s}\n{t}\n{e}", readme)
    return readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = parser.parse_args()
    current = README.read_text(encoding="utf-8")
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md's options tables are out of date: run "
                  "python scripts/gen_options_table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
