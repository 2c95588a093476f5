"""Shard layout: planned files load with the official safetensors readers; bad headers raise."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from gockpt.format import (
    CheckpointCorruptError,
    TensorSpec,
    decode_header,
    dtype_itemsize,
    encode_header,
    encoded_entries,
    plan_shards,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.dtype == torch.bool:
        return torch.rand(spec.shape, generator=g) > 0.5
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, generator=g).to(spec.dtype)
    return torch.randint(-100, 100, spec.shape, generator=g).to(spec.dtype)


def _shard_bytes(shard, tensors: dict[str, torch.Tensor]) -> bytes:
    data = bytearray(shard.data_bytes)
    for key, (begin, end) in shard.offsets.items():
        data[begin:end] = tensors[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return shard.header + bytes(data)


spec_lists = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 6), min_size=0, max_size=3),
    ),
    min_size=0,
    max_size=8,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=spec_lists, max_shard_bytes=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_planned_shards_load_with_official_safetensors(tmp_path, raw, max_shard_bytes, seed):
    specs = [TensorSpec(f"t{i}.w", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(raw)]
    tensors = {s.key: _random_tensor(s, seed + i) for i, s in enumerate(specs)}
    shards = plan_shards(specs, max_shard_bytes, "shard-test")

    seen = []
    for shard in shards:
        assert len(shard.header) % 8 == 0
        sizes = [end - begin for begin, end in shard.offsets.values()]
        assert sum(sizes) <= max_shard_bytes or len(shard.offsets) == 1
        for key, (begin, _end) in shard.offsets.items():
            assert begin % dtype_itemsize(tensors[key].dtype) == 0
        seen.extend(shard.offsets)

        path = tmp_path / shard.file
        path.write_bytes(_shard_bytes(shard, tensors))
        loaded = load_file(str(path))
        assert loaded.keys() == shard.offsets.keys()
        with safe_open(str(path), framework="pt") as f:
            assert set(f.keys()) == set(shard.offsets)
            for key in shard.offsets:
                got = f.get_tensor(key)
                assert got.dtype == tensors[key].dtype and got.shape == tensors[key].shape
                assert torch.equal(got, tensors[key])
                assert torch.equal(loaded[key], tensors[key])

        entries, data_start = decode_header(shard.header, shard.file_bytes, shard.file)
        assert data_start == len(shard.header)
        assert {k: tuple(e["data_offsets"]) for k, e in entries.items()} == shard.offsets
        assert encoded_entries(shard.header) == entries  # the persist's fast reader agrees
    assert sorted(seen) == sorted(tensors)


def test_empty_spec_list_gives_one_empty_shard():
    (shard,) = plan_shards([], 100, "p")
    assert shard.offsets == {} and shard.data_bytes == 0
    assert decode_header(shard.header, shard.file_bytes, "f") == ({}, len(shard.header))


def _header(obj: object) -> bytes:
    raw = json.dumps(obj).encode()
    return struct.pack("<Q", len(raw)) + raw


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("prefix", "file_bytes", "message"),
    [
        (b"\x01\x00", 2, "too short"),
        (_header(GOOD)[:20], len(_header(GOOD)) + 8, "header truncated"),
        (_header(GOOD), len(_header(GOOD)) + 4, "data section is 4 bytes"),
        (struct.pack("<Q", 1 << 40) + b"{}", 100, "overruns"),
        (struct.pack("<Q", 50) + b"{}", 20, "overruns"),
        (struct.pack("<Q", 5) + b"{not}", 13, "not valid JSON"),
        (_header([1, 2]), len(_header([1, 2])), "not a JSON object"),
        (
            _header({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}),
            len(_header(GOOD)) + 8,
            "unknown dtype",
        ),
        (
            _header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
            len(_header(GOOD)) + 8,
            "do not match its shape",
        ),
        (
            _header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}),
            len(_header(GOOD)) + 8,
            "malformed shape",
        ),
        (
            _header({"a": {"dtype": "F32", "shape": [2]}}),
            len(_header(GOOD)) + 8,
            "malformed header entry",
        ),
        (
            _header(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
                }
            ),
            None,
            "does not start where the previous ends",
        ),
    ],
)
def test_decode_header_rejects_bad_headers(prefix, file_bytes, message):
    if file_bytes is None:
        file_bytes = len(prefix) + 12
    with pytest.raises(CheckpointCorruptError, match=message) as info:
        decode_header(prefix, file_bytes, "dir/shard.safetensors")
    assert "dir/shard.safetensors" in str(info.value)


def test_encode_header_pads_to_eight_and_round_trips():
    spec = TensorSpec("x", torch.int16, (3,))
    header = encode_header([(spec, (0, 6))], {"format": "pt"})
    assert len(header) % 8 == 0
    entries, start = decode_header(header, len(header) + 6, "f")
    assert start == len(header)
    assert entries == {"x": {"dtype": "I16", "shape": [3], "data_offsets": [0, 6]}}


def test_plan_rejects_duplicates_and_bad_limit():
    spec = TensorSpec("x", torch.float32, (1,))
    with pytest.raises(ValueError, match="duplicate"):
        plan_shards([spec, spec], 10, "p")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        plan_shards([spec], 0, "p")
    with pytest.raises(TypeError, match="cannot be stored"):
        plan_shards([TensorSpec("c", torch.complex64, (1,))], 10, "p")
