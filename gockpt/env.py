"""``GOCKPT_*`` environment variables: their names, their parsing, and errors that name them.

An option ``<field>`` is read from the variable ``GOCKPT_<FIELD>`` (``max_inflight`` from
``GOCKPT_MAX_INFLIGHT``); ``GOCKPT_CONFIG_FILE`` names a YAML or JSON file of options. The
Accelerate adapter (:class:`accelerate_gockpt.GoCkptPlugin`) is the reader, because
``accelerate launch`` passes the environment to every process; this module holds what is not
Accelerate's, so that every reader reports a mistake the same way:

- a value that does not parse raises ``ValueError`` naming the variable and the value;
- a value that parses but is out of range (``GOCKPT_MODE=fastest``) is reported by
  :class:`gockpt.GoCkptConfig`, and :func:`name_source` puts the variable in front of its
  message;
- a ``GOCKPT_*`` variable that is no option (a misspelling) is logged once as a WARNING with the
  closest option name, instead of being ignored silently. A log rather than an exception or a
  Python warning, so a stray variable never fails a run or a test that forbids warnings.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import threading
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "env_name",
    "fill_unset",
    "name_source",
    "option_kinds",
    "parse_env_value",
    "read_config_file",
    "warn_unknown",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "GOCKPT_"
CONFIG_FILE_ENV = "GOCKPT_CONFIG_FILE"

TRUE_WORDS = ("1", "true", "yes", "y", "on", "t")
FALSE_WORDS = ("0", "false", "no", "n", "off", "f")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def env_name(field: str) -> str:
    """The variable that sets option ``field``: ``"max_inflight"`` -> ``"GOCKPT_MAX_INFLIGHT"``."""
    return ENV_PREFIX + field.upper()


def option_kinds(cls: type, exclude: Iterable[str] = ()) -> dict[str, type]:
    """Field -> ``bool``, ``int``, ``float`` or ``str`` for each field of dataclass ``cls`` whose
    annotation is one of them, alone or with ``None`` (others, e.g. mappings, are left out)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, type] = {}
    for f in fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or \
            typing.get_origin(hint) is typing.Union else (hint,)
        kinds = [a for a in args if a is not type(None)]
        if f.name not in exclude and len(kinds) == 1 and kinds[0] in (bool, int, float, str):
            out[f.name] = kinds[0]
    return out


def parse_env_value(raw: str, kind: type, where: str) -> Any:
    """Parse the text of a variable as a ``bool``, ``int``, ``float`` or ``str``.

    Booleans accept 1/0, true/false, yes/no, on/off (any case); integers may group digits with
    underscores (``4_194_304``); surrounding whitespace is ignored.

    Args:
        raw: the variable's value.
        kind: ``bool``, ``int``, ``float`` or ``str``.
        where: what to name in the error, e.g. ``"GOCKPT_MAX_INFLIGHT"``.

    Returns:
        The parsed value.

    Raises:
        ValueError: the text is not a ``kind``; the message is ``where='raw' is not ...``.
    """
    text = raw.strip()
    if kind is bool:
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise ValueError(f"{where}={raw!r} is not a truth value (use 1/0, true/false, yes/no, on/off)")
    if kind is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"{where}={raw!r} is not an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{where}={raw!r} is not a number") from None
    return text


def warn_unknown(known: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Log a WARNING, once per process and name, for every ``GOCKPT_*`` variable not in ``known``.

    Args:
        known: every variable name the caller reads (``GOCKPT_MODE``, ``GOCKPT_CONFIG_FILE``, ...).
        environ: the environment; ``os.environ`` when None.

    Returns:
        The unknown names, sorted (also the ones warned about before).
    """
    env = os.environ if environ is None else environ
    known_names = set(known)
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known_names)
    for name in unknown:
        with _warned_lock:
            if name in _warned:
                continue
            _warned.add(name)
        close = difflib.get_close_matches(name, sorted(known_names), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        logger.warning("gockpt: %s is not a GoCkpt option and is ignored%s", name, hint)
    return unknown


def name_source(error: ValueError, sources: Mapping[str, str]) -> ValueError:
    """Put where a bad value came from in front of a validation error.

    :class:`gockpt.GoCkptConfig` names the field in its errors (``"mode must be one of ...``);
    when that field's value came from a variable or a file, the user needs to see that one.

    Args:
        error: the validation error.
        sources: field -> its origin, e.g. ``{"mode": "GOCKPT_MODE='fastest'"}``; fields given
            as arguments are left out.

    Returns:
        A new ``ValueError`` whose message starts with the origin of the first field the message
        names, or ``error`` itself when it names none of ``sources``.
    """
    message = str(error)
    hits = []
    for field, origin in sources.items():
        match = re.search(rf"\b{re.escape(field)}\b", message)
        if match is not None:
            hits.append((match.start(), origin))
    if not hits:
        return error
    return ValueError(f"{min(hits)[1]}: {message}")


def read_config_file(path: str, known: Iterable[str]) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON file holding one mapping of option names.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a mapping, or a key that is not in ``known`` (naming the key).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml  # only for YAML files: an optional dependency

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of GoCkpt options, got {type(data).__name__}")
    names = sorted(known)
    for key in data:
        if key not in names:
            raise ValueError(f"{path}: unknown key {key!r}; known keys: {names}")
    return data


def _coerce(value: Any, kind: type, where: str) -> Any:
    # A config-file value: strings are parsed like variables, other values are type-checked.
    if isinstance(value, str):
        return parse_env_value(value, kind, where)
    ok = (
        (kind is bool and isinstance(value, bool))
        or (kind is int and isinstance(value, int) and not isinstance(value, bool))
        or (kind is float and isinstance(value, (int, float)) and not isinstance(value, bool))
    )
    if not ok:
        raise ValueError(f"{where}={value!r} has the wrong type")
    return float(value) if kind is float else value


def fill_unset(
    obj: Any, kinds: Mapping[str, type], config_file: str | None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Set every option of ``obj`` that is None from ``GOCKPT_<OPTION>``, else the config file.

    Arguments win over variables, variables over the file. Unknown ``GOCKPT_*`` variables are
    reported (:func:`warn_unknown`).

    Args:
        obj: an object whose attributes are the options (e.g. a dataclass).
        kinds: option name -> ``bool``, ``int``, ``float`` or ``str``.
        config_file: a YAML or JSON file of options, or None.
        environ: the environment; ``os.environ`` when None.

    Returns:
        Option -> where its value came from (for :func:`name_source`).

    Raises:
        ValueError: a value that does not parse, naming the variable or the file and key;
            an unknown key in the file.
    """
    env = os.environ if environ is None else environ
    from_file = read_config_file(config_file, kinds) if config_file else {}
    warn_unknown([env_name(name) for name in kinds] + [CONFIG_FILE_ENV], env)
    sources: dict[str, str] = {}
    for name, kind in kinds.items():
        if getattr(obj, name) is not None:
            continue
        var = env_name(name)
        if env.get(var, "") != "":
            setattr(obj, name, parse_env_value(env[var], kind, var))
            sources[name] = f"{var}={env[var]!r}"
        elif name in from_file:
            setattr(obj, name, _coerce(from_file[name], kind, f"{config_file}: {name}"))
            sources[name] = f"{config_file}: {name}={from_file[name]!r}"
    return sources
