"""The checkpoint manifest: build it at save time, validate it at load time. Pure, no I/O.

``manifest.json`` is the last file a save writes, and its presence is what makes a checkpoint
complete (GoCkpt §4.4.3: metadata written after the tensors). It lists every file with its size
and xxh3-64 checksum, indexes every tensor (file, safetensors dtype code, shape, data offsets),
maps alias keys of tied tensors to their stored key, and carries the engine's metadata::

    {"format": "gockpt", "format_version": 1,   (2 where an entry has "key", see below)
     "files": {name: {"bytes": int, "xxh3_64": "16 hex digits"}},
     "tensors": {key: {"file": name, "dtype": "F32", "shape": [..], "data_offsets": [b, e]}},
     (an entry also has "key", its name in the file's header, where a writer's files share key
      names, e.g. Accelerate's ``model.safetensors`` and ``model_1.safetensors``: the index key
      is then ``"<file>/<key>"``; see :func:`by_file`)
     "aliases": {alias_key: stored_key},
     "extra_file": name,
     "meta": {...}}
"""

from __future__ import annotations

import math
import re
from typing import Any

from gockpt.errors import CheckpointCorruptError
from gockpt.format import (
    CODE_TO_DTYPE,
    FORMAT_NAME,
    FORMAT_VERSION,
    READ_FORMAT_VERSIONS,
    MAX_NDIM,
    ShardLayout,
    encoded_entries,
    is_int,
    is_shape,
)

_HEX64_RE = re.compile(r"^[0-9a-f]{16}$")

#: ``meta.writer`` of one rank's part of a sharded checkpoint (:mod:`gockpt.sharded`): complete
#: as a directory, but only that rank's share of the state, never a checkpoint on its own.
PART_WRITER = "_PartWriter"


def is_part(manifest: dict) -> bool:
    """Whether a validated manifest is one rank's part of a sharded checkpoint."""
    return manifest["meta"].get("writer") == PART_WRITER


def check_name(name: Any, path: str) -> str:
    """Check that ``name`` is a plain file name that stays inside the checkpoint directory.

    Args:
        name: the candidate name.
        path: the file that holds the name, for the error message.

    Returns:
        ``name``, unchanged.

    Raises:
        CheckpointCorruptError: not a string, empty, absolute, or containing ``/``, ``\\``,
            ``..`` or NUL.
    """
    if (
        not isinstance(name, str)
        or not name
        or name == "."
        or ".." in name
        or any(c in name for c in ("/", "\\", "\0"))
    ):
        raise CheckpointCorruptError(
            f"{path}: invalid file name {name!r} (must be a plain file name)", path=path or None
        )
    return name


def build_manifest(
    shards: list[ShardLayout],
    files: dict[str, dict],
    aliases: dict[str, str],
    extra_file: str,
    meta: dict,
) -> dict:
    """Assemble the manifest of one checkpoint.

    Args:
        shards: the shard layouts written (from :func:`gockpt.format.plan_shards`).
        files: every file written, shards and extra blob: name -> {"bytes", "xxh3_64"}.
        aliases: alias key -> stored key (tied tensors).
        extra_file: name of the file holding the non-tensor state.
        meta: JSON-able engine metadata (requested_step, captured_step, mode, ...).

    Returns:
        The manifest dict, ready for ``json.dumps``.
    """
    tensors: dict[str, dict] = {}
    for shard in shards:
        for key, entry in encoded_entries(shard.header).items():  # this save's own headers
            record = {
                "file": shard.file,
                "dtype": entry["dtype"],
                "shape": list(entry["shape"]),
                "data_offsets": list(entry["data_offsets"]),
            }
            index_key = key
            if index_key in tensors:  # a key name another file of this writer uses too
                index_key, record["key"] = f"{shard.file}/{key}", key
                if index_key in tensors:
                    raise ValueError(f"tensor key {key!r} of {shard.file!r} cannot be indexed: "
                                     f"{index_key!r} is taken")
            tensors[index_key] = record
    keyed = any("key" in t for t in tensors.values())
    return {
        "format": FORMAT_NAME,
        # Version 1 where no entry needs a header key: older readers read those.
        "format_version": FORMAT_VERSION if keyed else 1,
        "files": {
            name: {"bytes": f["bytes"], "xxh3_64": f["xxh3_64"]} for name, f in files.items()
        },
        "tensors": tensors,
        "aliases": dict(aliases),
        "extra_file": extra_file,
        "meta": meta,
    }


def by_file(manifest: dict) -> dict[str, dict[str, dict]]:
    """The tensor index of a validated manifest grouped by file: file name -> {the tensor's
    key in that file's header -> its index entry}."""
    out: dict[str, dict[str, dict]] = {}
    for key, entry in manifest["tensors"].items():
        out.setdefault(entry["file"], {})[entry.get("key", key)] = entry
    return out


def _brief(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validate_manifest(obj: Any, path: str) -> dict:
    """Check the structure of a decoded manifest.

    Args:
        obj: the result of ``json.loads`` on ``manifest.json``.
        path: the manifest's path, for error messages.

    Returns:
        ``obj``, unchanged.

    Raises:
        CheckpointCorruptError: wrong format name or version, a missing or malformed field, a
            file name escaping the directory, a tensor in an unlisted file, a shape with more
            than :data:`gockpt.format.MAX_NDIM` dimensions or a dimension outside int64 range,
            a malformed ``meta.sharded`` (parts, replicated, world_size) or ``meta.writer``,
            data offsets whose span is not the shape's byte size, an alias to an unknown key;
            the message names ``path`` and the offending key or file.
    """

    def bad(msg: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: {msg}", path=path)

    if not isinstance(obj, dict):
        raise bad("manifest is not a JSON object")
    if obj.get("format") != FORMAT_NAME:
        raise bad(f"not a GoCkpt manifest (format {obj.get('format')!r})")
    version = obj.get("format_version")
    if not is_int(version) or version not in READ_FORMAT_VERSIONS:
        raise bad(f"format version {version!r}; this reader reads versions "
                  f"{', '.join(map(str, READ_FORMAT_VERSIONS))} (a newer GoCkpt wrote it?)")
    for field, kind in (("files", dict), ("tensors", dict), ("aliases", dict), ("meta", dict)):
        if not isinstance(obj.get(field), kind):
            raise bad(f"field {field!r} is missing or not an object")

    files = obj["files"]
    for name, entry in files.items():
        check_name(name, path)
        if not (
            isinstance(entry, dict)
            and is_int(entry.get("bytes"))
            and entry["bytes"] >= 0
            and isinstance(entry.get("xxh3_64"), str)
            and _HEX64_RE.match(entry["xxh3_64"])
        ):
            raise bad(f"file {name!r}: malformed entry {entry!r}")
    extra_file = check_name(obj.get("extra_file"), path)
    if extra_file not in files:
        raise bad(f"extra file {extra_file!r} is not listed in 'files'")
    for field in ("captured_step", "requested_step", "run"):
        if field in obj["meta"] and not is_int(obj["meta"][field]):
            raise bad(f"meta field {field!r} is not an integer: {obj['meta'][field]!r}")
    if "run" in obj["meta"] and not 0 <= obj["meta"]["run"] < 1 << 63:
        raise bad(f"meta field 'run' is not in [0, 2**63): {obj['meta']['run']!r}")
    if "writer" in obj["meta"] and not isinstance(obj["meta"]["writer"], str):
        raise bad(f"meta field 'writer' is not a string: {_brief(obj['meta']['writer'])}")
    if "sharded" in obj["meta"]:
        sharded = obj["meta"]["sharded"]
        if not (isinstance(sharded, dict) and isinstance(sharded.get("parts"), list)
                and all(isinstance(p, str) for p in sharded["parts"])
                and isinstance(sharded.get("replicated", False), bool)
                and is_int(sharded.get("world_size", 0))):
            raise bad(f"meta field 'sharded' is malformed: {_brief(sharded)}")

    seen: dict[tuple[str, str], str] = {}  # (file, header key) -> index key
    for key, entry in obj["tensors"].items():
        if not isinstance(key, str) or not key:
            raise bad(f"tensor key {key!r} is not a non-empty string")
        if not isinstance(entry, dict):
            raise bad(f"tensor {key!r}: malformed entry")
        file = check_name(entry.get("file"), path)
        if file not in files or file == extra_file:
            raise bad(f"tensor {key!r}: file {file!r} is not a listed shard")
        if "key" in entry and not (version >= 2 and isinstance(entry["key"], str)
                                   and key == f"{file}/{entry['key']}"):
            raise bad(f"tensor {key!r} in {file!r}: its header key {_brief(entry['key'])} is "
                      f"not the name after {file + '/'!r} (format version 2)")
        header_key = (file, entry.get("key", key))
        if header_key in seen:
            raise bad(f"tensor {key!r} in {file!r}: indexed twice (also as {seen[header_key]!r})")
        seen[header_key] = key
        dtype = entry.get("dtype")
        if not isinstance(dtype, str) or dtype not in CODE_TO_DTYPE:
            raise bad(f"tensor {key!r} in {file!r}: unknown dtype {entry.get('dtype')!r}")
        shape = entry.get("shape")
        if not is_shape(shape):
            raise bad(f"tensor {key!r} in {file!r}: malformed shape {_brief(shape)} (at most "
                      f"{MAX_NDIM} dimensions, each from 0 to 2**63 - 1, their product too)")
        offsets = entry.get("data_offsets")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(f"tensor {key!r} in {file!r}: malformed data_offsets {offsets!r}")
        nbytes = math.prod(shape) * CODE_TO_DTYPE[dtype].itemsize  # Python ints: no overflow
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"tensor {key!r} in {file!r}: data_offsets {offsets!r} span "
                      f"{offsets[1] - offsets[0]} bytes, its shape and dtype {nbytes}")

    tensors = obj["tensors"]
    for alias, target in obj["aliases"].items():
        if not isinstance(target, str) or target not in tensors:
            raise bad(f"alias {alias!r} points to unknown tensor {target!r}")
        if alias in tensors:
            raise bad(f"alias {alias!r} is also a stored tensor key")
    return obj
