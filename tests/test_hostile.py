"""Loading untrusted directories: only regular files inside the checkpoint are opened, sizes are
bounded before reading, JSON is strict, and every malformed entry is a CheckpointCorruptError
naming the file (and the key) - never a hang, a MemoryError, a RecursionError or a raw
TypeError/KeyError.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import threading

import pytest
import torch

from gockpt import storage
from gockpt.errors import CheckpointCorruptError
from gockpt.load import read_checkpoint
from gockpt.persist import persist
from gockpt.restore import load_checkpoint
from gockpt.storage import is_complete, latest_checkpoint


def corrupt_error(fn, *fragments, timeout_s=20.0):
    """Run ``fn`` in a thread; it must raise CheckpointCorruptError mentioning ``fragments``
    within ``timeout_s`` (a FIFO must not hang the loader)."""
    out: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - inspected below
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the loader hung"
    error = out.get("error")
    assert isinstance(error, CheckpointCorruptError), f"got {error!r}"
    for fragment in fragments:
        assert fragment in str(error), (fragment, str(error))
    return error


def manifest_of(store, name="ckpt"):
    return json.loads(store.fs.cat_file(store.fs_path(name, "manifest.json")))


def put_manifest_text(store, text, name="ckpt"):
    store.fs.pipe_file(store.fs_path(name, "manifest.json"), text.encode())


@pytest.fixture
def ckpt(store, make_request, make_tensors):
    """(store, manifest) of a valid checkpoint ``ckpt`` named by ``latest``."""
    persist(make_request(store.path("ckpt"), make_tensors(1), step=1))
    return store, manifest_of(store)


def shard_of(manifest):
    return sorted(n for n in manifest["files"] if n.endswith(".safetensors"))[0]


# --- local: no symlink, device or FIFO is opened ----------------------------------------------


@pytest.fixture
def local_ckpt(tmp_path, make_request, make_tensors):
    root = tmp_path / "store"
    persist(make_request(str(root / "ckpt"), make_tensors(1), step=1))
    manifest = json.loads((root / "ckpt" / "manifest.json").read_text())
    return root, manifest


def test_a_shard_symlinked_outside_the_checkpoint_is_refused(local_ckpt, tmp_path):
    root, manifest = local_ckpt
    shard = root / "ckpt" / shard_of(manifest)
    outside = tmp_path / "outside.safetensors"
    os.rename(shard, outside)  # the very same bytes: only the link is wrong
    shard.symlink_to(outside)
    corrupt_error(lambda: read_checkpoint(str(root / "ckpt")), shard.name, "symbolic link")
    assert not is_complete(str(root / "ckpt"))


@pytest.mark.parametrize("victim", ["state", "manifest.json", "latest"])
def test_files_symlinked_to_dev_zero_are_refused(local_ckpt, victim):
    root, manifest = local_ckpt
    name = manifest["extra_file"] if victim == "state" else victim
    path = root / name if victim == "latest" else root / "ckpt" / name
    path.unlink()
    path.symlink_to("/dev/zero")
    if victim == "latest":
        corrupt_error(lambda: latest_checkpoint(str(root)), "latest", "symbolic link")
    else:
        corrupt_error(lambda: read_checkpoint(str(root / "ckpt")), name, "symbolic link")


@pytest.mark.parametrize("victim", ["shard", "manifest.json", "latest"])
def test_a_fifo_does_not_hang_the_loader(local_ckpt, victim):
    root, manifest = local_ckpt
    name = shard_of(manifest) if victim == "shard" else victim
    path = root / name if victim == "latest" else root / "ckpt" / name
    path.unlink()
    os.mkfifo(path)
    if victim == "latest":
        corrupt_error(lambda: latest_checkpoint(str(root)), "latest", "FIFO")
    else:
        corrupt_error(lambda: read_checkpoint(str(root / "ckpt")), name, "FIFO")
        assert not is_complete(str(root / "ckpt"))


def test_a_device_node_is_refused(local_ckpt):
    root, manifest = local_ckpt
    path = root / "ckpt" / manifest["extra_file"]
    path.unlink()
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # like /dev/zero
    except PermissionError as e:
        pytest.skip(f"cannot create a device node here: {e}")
    corrupt_error(lambda: read_checkpoint(str(root / "ckpt")), path.name, "character device")


def test_a_directory_in_place_of_a_shard_is_refused(local_ckpt):
    root, manifest = local_ckpt
    path = root / "ckpt" / shard_of(manifest)
    path.unlink()
    path.mkdir()
    corrupt_error(lambda: read_checkpoint(str(root / "ckpt")), path.name, "directory")


def test_a_symlinked_checkpoint_directory_still_loads(local_ckpt, tmp_path):
    # Lightning's save_last="link" makes last.ckpt a link to a checkpoint directory.
    root, _ = local_ckpt
    (root / "last.ckpt").symlink_to(root / "ckpt")
    read_checkpoint(str(root / "last.ckpt"))


# --- every store: sizes bounded, strict JSON, typed entries --------------------------------------


def test_an_oversized_manifest_is_refused_before_it_is_read(ckpt):
    store, _ = ckpt
    put_manifest_text(store, " " * (storage.MAX_METADATA_BYTES + 1) + "{}")
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "larger than")


def test_an_oversized_pointer_is_refused(ckpt):
    store, _ = ckpt
    store.fs.pipe_file(store.fs_path("latest"), b" " * (storage.MAX_METADATA_BYTES + 1))
    corrupt_error(lambda: latest_checkpoint(store.root), "latest")


@pytest.mark.parametrize("depth", [100, 200_000])
def test_deeply_nested_json_is_refused(ckpt, depth):
    store, manifest = ckpt
    text = json.dumps({**manifest, "meta": "@"}).replace('"@"', "[" * depth + "]" * depth)
    put_manifest_text(store, text)
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "nested deeper")


def test_duplicate_json_keys_are_refused(ckpt):
    store, manifest = ckpt
    key = sorted(manifest["tensors"])[0]
    entry = json.dumps(manifest["tensors"][key])
    text = json.dumps(manifest).replace(f'"{key}": {entry}', f'"{key}": {entry}, "{key}": {entry}', 1)
    assert text.count(f'"{key}": ') >= 2
    put_manifest_text(store, text)
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "duplicate", key)
    store.fs.pipe_file(store.fs_path("latest"), b'{"name": "ckpt", "name": "x", "captured_step": 1}')
    corrupt_error(lambda: latest_checkpoint(store.root), "latest", "duplicate JSON key 'name'")


def test_json_constants_are_refused(ckpt):
    store, manifest = ckpt
    put_manifest_text(store, json.dumps({**manifest, "meta": {"loss": float("nan")}}))
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "NaN")


def _retype(path, value):
    def edit(m):
        target = m
        for part in path[:-1]:
            target = target[part if not callable(part) else part(target)]
        last = path[-1]
        target[last if not callable(last) else last(target)] = value
        return m
    return edit


def first_tensor(tensors):
    return sorted(tensors)[0]


WRONG_TYPES = {
    "dtype is a list": (("tensors", first_tensor, "dtype"), ["F32"], "unknown dtype"),
    "shape is a dict": (("tensors", first_tensor, "shape"), {"a": 1}, "malformed shape"),
    "offsets are strings": (("tensors", first_tensor, "data_offsets"), ["0", "4"], "data_offsets"),
    "tensor entry is a string": (("tensors", first_tensor), "x", "malformed entry"),
    "file size is a string": (("files", lambda f: sorted(f)[0], "bytes"), "12", "malformed entry"),
    "file entry is null": (("files", lambda f: sorted(f)[0]), None, "malformed entry"),
    "extra_file is a number": (("extra_file",), 7, "invalid file name"),
    "alias target is a dict": (("aliases", "tied"), {"x": 1}, "'tied'"),
    "captured_step is a string": (("meta", "captured_step"), "1", "captured_step"),
    "files is a list": (("files",), [], "'files'"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_types_in_the_manifest_name_the_entry(ckpt, case):
    store, manifest = ckpt
    path, value, fragment = WRONG_TYPES[case]
    put_manifest_text(store, json.dumps(_retype(path, value)(manifest)))
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", fragment)
    assert not is_complete(store.path("ckpt"))
    # latest names it, but a reader falls back to scanning and finds nothing complete.
    assert latest_checkpoint(store.root) is None


def test_a_huge_header_length_is_refused(ckpt):
    store, manifest = ckpt
    name = shard_of(manifest)
    path = store.fs_path("ckpt", name)
    data = bytearray(store.fs.cat_file(path))
    data[:8] = struct.pack("<Q", (1 << 63) - 1)
    store.fs.pipe_file(path, bytes(data))
    corrupt_error(lambda: read_checkpoint(store.path("ckpt"), verify=False), name, "overruns")


def test_a_truncated_state_blob_is_refused(ckpt):
    store, manifest = ckpt
    name = manifest["extra_file"]
    path = store.fs_path("ckpt", name)
    store.fs.pipe_file(path, store.fs.cat_file(path)[:10])
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), name, "manifest says")


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"optimizers": "x", "model_extra": {}}, "'optimizers'"),
        ({"optimizers": [], "model_extra": [1]}, "'model_extra'"),
        ({"optimizers": [{"state": [], "param_groups": []}], "model_extra": {}}, "optimizers[0]"),
        ({"optimizers": [{"state": {"a": {}}, "param_groups": []}], "model_extra": {}}, "'a'"),
        ({"optimizers": [{"state": {0: 5}, "param_groups": []}], "model_extra": {}}, "state entry 0"),
        ({"optimizers": [{"state": {}}], "model_extra": {}}, "param_groups"),
    ],
)
def test_malformed_state_entries_name_the_file_and_entry(store, make_request, extra, fragment):
    persist(make_request(store.path("ckpt"), {"model.w": torch.ones(3)}, step=1, extra=extra))
    error = corrupt_error(lambda: load_checkpoint(store.path("ckpt")), fragment)
    assert "state-" in str(error)


def test_a_hostile_directory_never_breaks_scanning(store, make_request, make_tensors):
    persist(make_request(store.path("good"), make_tensors(1), step=1, update_latest=False))
    persist(make_request(store.path("evil"), make_tensors(1), step=9, update_latest=False))
    put_manifest_text(store, "[" * 100_000, name="evil")
    store.fs.pipe_file(store.fs_path("junk"), b"not a directory")
    assert latest_checkpoint(store.root) == store.path("good")

