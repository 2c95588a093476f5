"""The safetensors layout of shard files: encode and decode headers, lay tensors out.

A shard file is ``u64 little-endian header length | JSON header | data``. The header maps a
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the
start of the data section; the data section holds the tensors back to back, with no holes.
This module neither opens files nor touches devices.

Tensors are ordered by element size, largest first, so every tensor starts at a multiple of its
own element size; host snapshot slots use the same offsets, so a shard is written straight from
the slot with no serialization copy (DataStates-LLM §V-A3: fixed tensor offsets and a header).
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from .errors import CheckpointCorruptError

__all__ = [
    "CODE_TO_DTYPE",
    "DTYPE_TO_CODE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READ_FORMAT_VERSIONS",
    "MAX_HEADER_BYTES",
    "MAX_DIM",
    "MAX_JSON_DEPTH",
    "MAX_NDIM",
    "CheckpointCorruptError",
    "ShardLayout",
    "TensorSpec",
    "decode_header",
    "decode_json",
    "dtype_code",
    "dtype_itemsize",
    "encode_header",
    "encoded_entries",
    "is_shape",
    "plan_shards",
]

FORMAT_NAME = "gockpt"
FORMAT_VERSION = 2
"""The newest manifest format this code writes and reads. Version 2 adds a tensor entry's
``"key"`` (its name in the file's header, where a writer's files share key names); a manifest
that needs none is still written as version 1, which older readers read."""
READ_FORMAT_VERSIONS = (1, 2)

DTYPE_TO_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CODE_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_CODE.items()}

#: The largest header this reader accepts (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20

#: The deepest nesting of JSON arrays and objects a decoder here accepts. Our manifests and
#: headers nest 4 levels; the bound turns hostile input into an error, not a RecursionError.
MAX_JSON_DEPTH = 64

#: The most dimensions a stored tensor may have.
MAX_NDIM = 64

#: The largest size of one dimension (torch sizes are 64-bit signed integers).
MAX_DIM = (1 << 63) - 1


def decode_json(raw: bytes | str, path: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode JSON strictly: UTF-8, no duplicate object keys, nesting at most ``max_depth``.

    Args:
        raw: the encoded document (bound its size before reading it).
        path: the file it came from, for error messages.
        max_depth: the deepest nesting of arrays/objects accepted, >= 1.

    Returns:
        The decoded value.

    Raises:
        CheckpointCorruptError: not UTF-8, not JSON, a duplicate key (named), NaN/Infinity,
            or nested deeper than ``max_depth``.
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                raise CheckpointCorruptError(f"{path}: duplicate JSON key {key!r}", path=path)
            obj[key] = value
        return obj

    def constant(name: str) -> Any:
        raise CheckpointCorruptError(f"{path}: JSON constant {name} is not allowed", path=path)

    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        obj = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(f"{path}: not valid UTF-8 ({e})", path=path) from None
    except json.JSONDecodeError as e:
        raise CheckpointCorruptError(f"{path}: not valid JSON ({e})", path=path) from None
    except RecursionError:
        raise CheckpointCorruptError(
            f"{path}: JSON nested deeper than {max_depth} levels", path=path
        ) from None
    # The C decoder recurses once per level, bounded by the interpreter's recursion limit;
    # this walk (iterative) enforces the much smaller bound.
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise CheckpointCorruptError(
                    f"{path}: JSON nested deeper than {max_depth} levels", path=path
                )
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
    return obj


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool`` (JSON's numbers as a manifest holds them)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_shape(value: Any) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of at most :data:`MAX_NDIM` integers (not bools), each in
    ``[0, MAX_DIM]``, whose nonzero ones multiply to at most ``MAX_DIM``: a shape torch can
    hold (torch multiplies every dimension, a 0 among them too, and refuses an overflow)."""
    if not (isinstance(value, list) and len(value) <= MAX_NDIM
            and all(type(s) is int and 0 <= s <= MAX_DIM for s in value)):
        return False
    n = 1
    for s in value:
        n *= s or 1
        if n > MAX_DIM:
            return False
    return True


@dataclass(frozen=True)
class TensorSpec:
    """Metadata of one tensor to store.

    Attributes:
        key: unique name in the checkpoint.
        dtype: element type; must be in :data:`DTYPE_TO_CODE`.
        shape: tensor shape.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @functools.cached_property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor of one shard file lies.

    Attributes:
        file: file name inside the checkpoint directory.
        header: the encoded prefix (length + JSON header, padded to 8 bytes).
        offsets: key -> (begin, end) byte offsets inside the data section.
        data_bytes: size of the data section in bytes.
    """

    file: str
    header: bytes
    offsets: dict[str, tuple[int, int]]
    data_bytes: int

    @property
    def file_bytes(self) -> int:
        """Total size of the shard file in bytes."""
        return len(self.header) + self.data_bytes


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


def dtype_code(dtype: torch.dtype, key: str) -> str:
    """The safetensors code of ``dtype``.

    Raises:
        TypeError: the dtype has no safetensors code (names ``key``).
    """
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise TypeError(f"tensor {key!r}: dtype {dtype} cannot be stored") from None


def encode_header(
    entries: list[tuple[TensorSpec, tuple[int, int]]], metadata: dict[str, str] | None = None
) -> bytes:
    """Encode ``u64 length | JSON`` for the given (spec, offsets), padded with spaces to 8 bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for spec, (begin, end) in entries:
        header[spec.key] = {
            "dtype": dtype_code(spec.dtype, spec.key),
            "shape": list(spec.shape),
            "data_offsets": [begin, end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def encoded_entries(prefix: bytes) -> dict[str, dict]:
    """The tensor entries of a header this process made with :func:`encode_header`.

    Its inverse for trusted bytes only: json's C decoder, no limits and no checks (a file read
    from storage goes through :func:`decode_header`, whose per-object checks cost about 2 ms per
    100 tensors of GIL-held Python on the persist thread of every save).

    Args:
        prefix: ``u64 length | JSON`` as :func:`encode_header` returns it.

    Returns:
        key -> ``{"dtype": code, "shape": [...], "data_offsets": [begin, end]}`` (bytes within
        the data section); ``__metadata__`` left out.

    Raises:
        struct.error, ValueError: ``prefix`` is not what :func:`encode_header` made (never for
            its output; untrusted bytes belong to :func:`decode_header`).
    """
    (n,) = struct.unpack("<Q", prefix[:8])
    entries = json.loads(prefix[8 : 8 + n])
    entries.pop("__metadata__", None)
    return entries


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int, prefix: str) -> list[ShardLayout]:
    """Lay tensors out in shard files of at most ``max_shard_bytes`` data bytes each.

    Pure: no I/O. Tensors are sorted by element size (largest first), then by key, so every
    offset is a multiple of the tensor's element size. A tensor larger than the limit gets a
    shard of its own.

    Args:
        specs: tensors to store; keys must be unique.
        max_shard_bytes: data bytes per shard, >= 1.
        prefix: file name prefix; files are ``{prefix}-{i:05d}-of-{n:05d}.safetensors``.

    Returns:
        The shard layouts, in file order. An empty ``specs`` gives one empty shard.

    Raises:
        ValueError: duplicate keys or a non-positive ``max_shard_bytes``.
        TypeError: a dtype that safetensors cannot store.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate tensor keys in checkpoint layout")
    ordered = sorted(specs, key=lambda s: (-dtype_itemsize(s.dtype), s.key))
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in ordered:
        if groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    # Within a group, element sizes are already non-increasing, which keeps offsets aligned.
    n = len(groups)
    layouts = []
    for i, group in enumerate(groups):
        entries = []
        offset = 0
        for spec in group:
            entries.append((spec, (offset, offset + spec.nbytes)))
            offset += spec.nbytes
        layouts.append(
            ShardLayout(
                file=f"{prefix}-{i:05d}-of-{n:05d}.safetensors",
                header=encode_header(entries, {"format": "pt"}),
                offsets={spec.key: span for spec, span in entries},
                data_bytes=offset,
            )
        )
    return layouts


def decode_header(prefix: bytes, file_bytes: int, path: str) -> tuple[dict[str, dict], int]:
    """Decode and validate a shard header.

    Args:
        prefix: at least the first ``8 + header length`` bytes of the file.
        file_bytes: the file's total size in bytes.
        path: the file's path, for error messages.

    Returns:
        (tensor entries without ``__metadata__``, offset of the data section in bytes).

    Raises:
        CheckpointCorruptError: truncated file, header overrunning the file, bad JSON, unknown
            dtype, a malformed shape (not a list, over :data:`MAX_NDIM` dimensions, a dimension
            outside ``[0, MAX_DIM]``), offsets that do not match the shape or leave holes /
            overrun the data section.
    """
    if len(prefix) < 8 or file_bytes < 8:
        raise CheckpointCorruptError(f"{path}: file too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_bytes:
        raise CheckpointCorruptError(f"{path}: header length {n} overruns the file ({file_bytes} bytes)")
    if len(prefix) < 8 + n:
        raise CheckpointCorruptError(f"{path}: header truncated")
    header = decode_json(bytes(prefix[8 : 8 + n]), path)
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = file_bytes - 8 - n
    spans = []
    for key, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointCorruptError(f"{path}: malformed header entry for {key!r}") from None
        if not isinstance(code, str) or code not in CODE_TO_DTYPE:
            raise CheckpointCorruptError(f"{path}: tensor {key!r} has unknown dtype {code!r}")
        if not is_shape(shape):
            raise CheckpointCorruptError(
                f"{path}: tensor {key!r} has a malformed shape (at most {MAX_NDIM} dimensions, "
                f"each from 0 to 2**63 - 1, their product too)"
            )
        spec = TensorSpec(key, CODE_TO_DTYPE[code], tuple(shape))
        if not (type(begin) is int and type(end) is int) or end - begin != spec.nbytes:
            raise CheckpointCorruptError(f"{path}: tensor {key!r}: offsets do not match its shape")
        spans.append((begin, end, key))
    spans.sort()
    pos = 0
    for begin, end, key in spans:
        if begin != pos:
            raise CheckpointCorruptError(f"{path}: tensor {key!r} does not start where the previous ends")
        pos = end
    if pos != data_bytes:
        raise CheckpointCorruptError(
            f"{path}: data section is {data_bytes} bytes but tensors cover {pos}"
        )
    return header, 8 + n
