"""read_checkpoint(): bad input raises naming the file and key; good checkpoints load."""

from __future__ import annotations

import gc
import io
import json

import pytest
import torch

from gockpt.format import CheckpointCorruptError, ShardLayout, TensorSpec, encode_header
from gockpt.load import read_checkpoint
from gockpt.persist import PersistRequest, persist


class Opaque:
    """Not on torch.load's weights_only allow-list."""

    def __init__(self, value: int) -> None:
        self.value = value


def _manifest(store, name):
    return json.loads(store.fs.cat_file(store.fs_path(name, "manifest.json")))


def _put_manifest(store, name, obj):
    store.fs.pipe_file(store.fs_path(name, "manifest.json"), json.dumps(obj).encode())


def _shards(manifest):
    return sorted(n for n in manifest["files"] if n.endswith(".safetensors"))


def _rewrite(store, name, file, fn):
    path = store.fs_path(name, file)
    store.fs.pipe_file(path, fn(bytearray(store.fs.cat_file(path))))


def _flip_last(data: bytearray) -> bytes:
    data[-1] ^= 0xFF
    return bytes(data)


def _key_in(manifest, file):
    return sorted(k for k, e in manifest["tensors"].items() if e["file"] == file)[0]


def truncate(store, m):
    shard = _shards(m)[0]
    _rewrite(store, "bad", shard, lambda d: bytes(d[:-5]))
    return [shard, "bytes but the manifest says"]


def flip_data_byte(store, m):
    shard = _shards(m)[0]
    _rewrite(store, "bad", shard, _flip_last)
    return [shard, "checksum"]


def malformed_json(store, m):
    store.fs.pipe_file(store.fs_path("bad", "manifest.json"), b'{"format": "gockpt", ')
    return ["manifest.json", "not valid JSON"]


def wrong_format(store, m):
    _put_manifest(store, "bad", {**m, "format": "other"})
    return ["manifest.json", "not a GoCkpt manifest"]


def wrong_version(store, m):
    _put_manifest(store, "bad", {**m, "format_version": 99})
    return ["manifest.json", "format version 99"]


def escaping_tensor_key(store, m):
    shard = _shards(m)[0]
    m["tensors"]["../evil"] = dict(m["tensors"][_key_in(m, shard)])
    _put_manifest(store, "bad", m)
    return [shard, "'../evil'", "not in the header"]


def escaping_file_name(store, m):
    m["files"]["../evil.safetensors"] = {"bytes": 8, "xxh3_64": "0" * 16}
    _put_manifest(store, "bad", m)
    return ["manifest.json", "'../evil.safetensors'", "invalid file name"]


def escaping_tensor_file(store, m):
    key = sorted(m["tensors"])[0]
    m["tensors"][key]["file"] = "../../etc/passwd"
    _put_manifest(store, "bad", m)
    return ["manifest.json", "'../../etc/passwd'"]


def escaping_extra_file(store, m):
    m["extra_file"] = "/abs/state.pt"
    _put_manifest(store, "bad", m)
    return ["manifest.json", "'/abs/state.pt'"]


def missing_shard(store, m):
    shard = _shards(m)[-1]
    store.fs.rm_file(store.fs_path("bad", shard))
    return [shard, "missing"]


def missing_extra(store, m):
    store.fs.rm_file(store.fs_path("bad", m["extra_file"]))
    return [m["extra_file"], "missing"]


def unknown_alias(store, m):
    m["aliases"]["tied.weight"] = "no.such.key"
    _put_manifest(store, "bad", m)
    return ["manifest.json", "'tied.weight'", "'no.such.key'"]


def shape_disagrees(store, m):
    key = "layer.weight"
    m["tensors"][key]["shape"] = [33, 64]
    _put_manifest(store, "bad", m)
    return [m["tensors"][key]["file"], repr(key), "shape"]


def key_missing_from_manifest(store, m):
    key = "counts"
    file = m["tensors"].pop(key)["file"]
    _put_manifest(store, "bad", m)
    return [file, repr(key), "not in the manifest"]


def malformed_file_entry(store, m):
    shard = _shards(m)[0]
    m["files"][shard]["xxh3_64"] = "not-hex"
    _put_manifest(store, "bad", m)
    return ["manifest.json", shard]


CORRUPTIONS = [
    truncate,
    flip_data_byte,
    malformed_json,
    wrong_format,
    wrong_version,
    escaping_tensor_key,
    escaping_file_name,
    escaping_tensor_file,
    escaping_extra_file,
    missing_shard,
    missing_extra,
    unknown_alias,
    shape_disagrees,
    key_missing_from_manifest,
    malformed_file_entry,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_bad_input_raises_naming_file_and_key(store, make_request, make_tensors, corrupt):
    good = make_tensors(1)
    persist(make_request(store.path("good"), good, step=1, update_latest=False))
    persist(make_request(store.path("bad"), make_tensors(2), step=2, update_latest=False))

    expected = corrupt(store, _manifest(store, "bad") if corrupt is not malformed_json else None)

    with pytest.raises(CheckpointCorruptError) as info:
        read_checkpoint(store.path("bad"))
    for fragment in expected:
        assert fragment in str(info.value)
    loaded = read_checkpoint(store.path("good"))
    assert all(torch.equal(loaded.tensors[k], v) for k, v in good.items())


def test_missing_manifest_is_file_not_found(store, make_request, make_tensors):
    with pytest.raises(FileNotFoundError, match="not a complete GoCkpt checkpoint"):
        read_checkpoint(store.path("nothing"))
    persist(make_request(store.path("ckpt"), make_tensors(1)))
    store.fs.rm_file(store.fs_path("ckpt", "manifest.json"))
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        read_checkpoint(store.path("ckpt"))


def test_verify_false_skips_checksums_but_not_structure(store, make_request, make_tensors):
    tensors = make_tensors(1)
    persist(make_request(store.path("ckpt"), tensors, update_latest=False))
    manifest = _manifest(store, "ckpt")
    file = manifest["tensors"]["layer.weight"]["file"]
    # A flipped data byte is only caught by the checksum.
    _rewrite(store, "ckpt", file, _flip_last)
    loaded = read_checkpoint(store.path("ckpt"), verify=False)
    differs = [k for k, v in tensors.items() if not torch.equal(loaded.tensors[k], v)]
    assert len(differs) == 1 and manifest["tensors"][differs[0]]["file"] == file
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        read_checkpoint(store.path("ckpt"))

    # A header that no longer matches the manifest is caught without checksums.
    def retag(data: bytearray) -> bytes:
        return bytes(data).replace(
            b'"layer.weight":{"dtype":"F32"', b'"layer.weight":{"dtype":"I32"', 1
        )

    _rewrite(store, "ckpt", file, retag)
    with pytest.raises(CheckpointCorruptError, match=r"'layer.weight': header dtype 'I32'"):
        read_checkpoint(store.path("ckpt"), verify=False)


def test_undecodable_extra_state_raises(store, make_request, make_tensors):
    persist(make_request(store.path("ckpt"), make_tensors(1), update_latest=False))
    extra = _manifest(store, "ckpt")["extra_file"]
    _rewrite(store, "ckpt", extra, lambda d: b"\0" * len(d))
    with pytest.raises(CheckpointCorruptError, match=extra):
        read_checkpoint(store.path("ckpt"), verify=False)


def test_pickled_extra_needs_allow_pickle(store, make_request, make_tensors):
    persist(make_request(store.path("ckpt"), make_tensors(1), extra={"obj": Opaque(3)}))
    with pytest.raises(CheckpointCorruptError, match="allow_pickle"):
        read_checkpoint(store.path("ckpt"))
    loaded = read_checkpoint(store.path("ckpt"), allow_pickle=True)
    assert isinstance(loaded.extra["obj"], Opaque) and loaded.extra["obj"].value == 3


def test_local_tensors_outlive_the_call_and_never_write_the_file(
    tmp_path, make_request, make_tensors
):
    tensors = make_tensors(1)
    path = str(tmp_path / "ckpt")
    persist(make_request(path, tensors, update_latest=False))
    loaded = read_checkpoint(path).tensors
    gc.collect()
    for key, want in tensors.items():
        assert loaded[key].device.type == "cpu" and torch.equal(loaded[key], want)
    loaded["layer.weight"].zero_()  # copy-on-write mapping: the file keeps its bytes
    again = read_checkpoint(path).tensors
    assert torch.equal(again["layer.weight"], tensors["layer.weight"])


def test_unaligned_tensor_in_a_valid_file_loads(store):
    # A layout our planner never makes (a float after a byte), but a valid safetensors file.
    small = torch.tensor([7], dtype=torch.uint8)
    big = torch.tensor([1.5, -2.25], dtype=torch.float32)
    entries = [
        (TensorSpec("b", torch.uint8, (1,)), (0, 1)),
        (TensorSpec("f", torch.float32, (2,)), (1, 9)),
    ]
    shard = ShardLayout(
        "shard-x-00000-of-00001.safetensors", encode_header(entries), {"b": (0, 1), "f": (1, 9)}, 9
    )
    slot = torch.cat([small, big.view(torch.uint8)])
    blob = io.BytesIO()
    torch.save({}, blob)
    persist(
        PersistRequest(
            path=store.path("ckpt"),
            shards=[shard],
            slot=slot,
            shard_bases=[0],
            extra=blob.getvalue(),
            aliases={},
            meta={},
            update_latest=False,
        )
    )
    loaded = read_checkpoint(store.path("ckpt")).tensors
    assert torch.equal(loaded["b"], small) and torch.equal(loaded["f"], big)


def test_s3_checksum_mismatch_names_the_file(s3_store, make_request, make_tensors):
    opts = s3_store.storage_options
    persist(make_request(s3_store.path("ckpt"), make_tensors(1), storage_options=opts))
    shard = _shards(_manifest(s3_store, "ckpt"))[1]
    _rewrite(s3_store, "ckpt", shard, _flip_last)
    with pytest.raises(CheckpointCorruptError, match=f"{shard}: xxh3-64 checksum"):
        read_checkpoint(s3_store.path("ckpt"), storage_options=opts)


def test_a_loaded_rng_state_restores_the_generator(store, make_request):
    # torch.set_rng_state ignores a view's storage offset: small tensors get their own storage.
    state = torch.get_rng_state()
    want = torch.rand(4)
    tensors = {"a.big": torch.ones(100), "rng": state, "z": torch.zeros(3)}
    persist(make_request(store.path("ckpt"), tensors, max_shard_bytes=1 << 20, update_latest=False))
    loaded = read_checkpoint(store.path("ckpt")).tensors
    torch.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(4), want)



def test_a_remote_shard_is_read_piece_by_piece_into_its_tensors(make_request, monkeypatch):
    """A shard on a store that may hang is read in bounded pieces, each going straight into the
    tensors it covers (storage of their own): no whole-file ``bytes`` is held besides them, the
    header may span several pieces, and every tensor loads bit for bit."""
    import tracemalloc
    import uuid

    import fsspec

    import gockpt._safe_read

    monkeypatch.setattr(gockpt._safe_read, "READ_PIECE_BYTES", 4096)
    tensors = {f"layer.{i:03d}.a_rather_long_parameter_name": torch.randn(3) for i in range(200)}
    tensors.update(big=torch.randn(1 << 19), small=torch.arange(10, dtype=torch.int16))
    root = f"memory://gockpt-test-{uuid.uuid4().hex}"
    try:
        persist(make_request(f"{root}/ckpt", tensors, max_shard_bytes=64 << 20, chunk_bytes=1 << 20,
                             update_latest=False))
        shard = next(n for n in _manifest_at(root) if n.endswith(".safetensors"))
        header = int.from_bytes(fsspec.filesystem("memory").cat_file(f"{root}/ckpt/{shard}", 0, 8), "little")
        assert header > 2 * 4096  # the header spans pieces
        tracemalloc.start()
        try:
            loaded = read_checkpoint(f"{root}/ckpt").tensors
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        for key, want in tensors.items():
            assert loaded[key].dtype == want.dtype and torch.equal(loaded[key], want), key
        assert loaded["big"].untyped_storage().nbytes() == tensors["big"].nbytes  # its own
        assert peak < (1 << 20), peak  # the 2 MiB shard was never held as bytes
        # Damage told as for a whole file: a changed byte by the checksum, a cut file by its size.
        mfs, path = fsspec.filesystem("memory"), f"{root}/ckpt/{shard}"
        good = mfs.cat_file(path)
        mfs.pipe_file(path, good[:-5000] + bytes([good[-5000] ^ 1]) + good[-4999:])
        with pytest.raises(CheckpointCorruptError, match="checksum"):
            read_checkpoint(f"{root}/ckpt")
        mfs.pipe_file(path, good[:-100])
        with pytest.raises(CheckpointCorruptError, match="bytes but the manifest says"):
            read_checkpoint(f"{root}/ckpt")
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _manifest_at(root: str) -> dict:
    import fsspec

    return json.loads(fsspec.filesystem("memory").cat_file(f"{root}/ckpt/manifest.json"))["files"]
