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


def test_a_checkpoint_directory_that_is_a_symlink_loop_is_a_corrupt_checkpoint(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    corrupt_error(lambda: read_checkpoint(str(tmp_path / "a")), "symbolic link loop")
    corrupt_error(lambda: load_checkpoint(str(tmp_path / "a")), "symbolic link loop")


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
    "header key is a number": (("tensors", first_tensor, "key"), 3, "header key"),
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


def test_a_tensor_indexed_twice_is_refused(ckpt):
    """Format version 2 names a header key beside an index key: two index entries for one
    tensor of one file would leave one of them unchecked against the header."""
    store, manifest = ckpt
    key = first_tensor(manifest["tensors"])
    entry = manifest["tensors"][key]
    manifest["format_version"] = 2
    manifest["tensors"][f"{entry['file']}/{key}"] = {**entry, "key": key}
    put_manifest_text(store, json.dumps(manifest))
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "indexed twice")


def test_a_newer_format_version_is_named_as_such(ckpt):
    store, manifest = ckpt
    put_manifest_text(store, json.dumps({**manifest, "format_version": 3}))
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "newer GoCkpt")


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



# --- shapes: each dimension in int64 range, at most MAX_NDIM dimensions ----------------------


def _add_tensor(store, manifest, key, entry, name="ckpt"):
    """Add ``key`` to the first shard's header and to the manifest, sizes and checksums fixed
    up: a checkpoint consistent in every respect but the entry itself."""
    import xxhash

    shard = shard_of(manifest)
    path = store.fs_path(name, shard)
    data = store.fs.cat_file(path)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[key] = entry
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    new = struct.pack("<Q", len(raw)) + raw + data[8 + n :]
    store.fs.pipe_file(path, new)
    manifest["files"][shard] = {"bytes": len(new), "xxh3_64": xxhash.xxh3_64_hexdigest(new)}
    manifest["tensors"][key] = {"file": shard, **entry}
    put_manifest_text(store, json.dumps(manifest), name=name)


HOSTILE_SHAPES = {
    "a dimension over int64": [0, 10**30],
    "a dimension of 2**63": [0, 1 << 63],
    "65 dimensions": [0] * 65,
    "dimensions multiplying past int64": [1 << 62, 1 << 62, 0],
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SHAPES))
def test_a_hostile_shape_is_refused_naming_the_file_and_key(ckpt, case, capsys):
    from gockpt.cli import main

    store, manifest = ckpt
    _add_tensor(store, manifest, "evil", {"dtype": "F32", "shape": HOSTILE_SHAPES[case],
                                          "data_offsets": [0, 0]})
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", "'evil'", "shape")
    assert main(["verify", store.path("ckpt")]) == 1
    err = capsys.readouterr().err
    assert "'evil'" in err and "malformed shape" in err and "frame #" not in err, err


@pytest.mark.parametrize("case", sorted(HOSTILE_SHAPES))
def test_a_hostile_shape_in_a_shard_header_is_refused(case):
    from gockpt.format import decode_header

    raw = json.dumps({"evil": {"dtype": "F32", "shape": HOSTILE_SHAPES[case],
                               "data_offsets": [0, 0]}}).encode()
    with pytest.raises(CheckpointCorruptError, match="'evil' has a malformed shape"):
        decode_header(struct.pack("<Q", len(raw)) + raw, 8 + len(raw), "x.safetensors")


def test_the_largest_shape_allowed_still_loads(ckpt):
    store, manifest = ckpt
    _add_tensor(store, manifest, "wide", {"dtype": "F32", "shape": [0, (1 << 63) - 1],
                                          "data_offsets": [0, 0]})
    _add_tensor(store, manifest, "deep", {"dtype": "F32", "shape": [0] * 64,
                                          "data_offsets": [0, 0]})
    tensors = read_checkpoint(store.path("ckpt")).tensors
    assert tensors["wide"].shape == (0, (1 << 63) - 1) and tensors["deep"].dim() == 64


def test_offsets_that_disagree_with_the_shape_are_refused_in_the_manifest(ckpt):
    store, manifest = ckpt
    key = "layer.weight"
    manifest["tensors"][key]["shape"] = [64, 34]
    put_manifest_text(store, json.dumps(manifest))
    corrupt_error(lambda: read_checkpoint(store.path("ckpt")), "manifest.json", repr(key),
                  "data_offsets")


# --- sharded checkpoints: the same rules for every file of every part -----------------------


@pytest.fixture(scope="module")
def sharded_template(tmp_path_factory):
    """A sharded checkpoint of one rank (gloo, in this process) and the model it holds."""
    import torch.distributed as dist

    from gockpt import GoCkptConfig
    from gockpt.sharded import ShardedEngine

    assert not dist.is_initialized()
    path = str(tmp_path_factory.mktemp("sharded") / "ck")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = ShardedEngine(model, opt, GoCkptConfig(mode="sync"), commit_timeout_s=30)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        engine.step_end()
        engine.save(path).result()
        engine.close()
    finally:
        dist.destroy_process_group()
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def sharded(sharded_template, tmp_path):
    import shutil

    from gockpt.dcp import load_full

    template, want = sharded_template
    path = tmp_path / "ck"
    shutil.copytree(template, path)
    got = load_full(str(path)).model_state_dict  # the copy loads before it is damaged
    assert all(torch.equal(got[k], v) for k, v in want.items())
    return path


def _part_shard(path):
    return next((path / "rank-00000").glob("*.safetensors"))


SHARDED_VICTIMS = {
    "shard": _part_shard,
    "part manifest": lambda p: p / "rank-00000" / "manifest.json",
    "part state": lambda p: next((p / "rank-00000").glob("state-*")),
    "sharding": lambda p: p / "rank-00000.sharding.json",
    "index": lambda p: p / "sharded.json",
}


@pytest.mark.parametrize("kind", ["FIFO", "symbolic link"])
@pytest.mark.parametrize("victim", sorted(SHARDED_VICTIMS))
def test_a_sharded_checkpoint_refuses_fifos_and_links_to_dev_zero(sharded, victim, kind):
    from gockpt.dcp import GoCkptStorageReader, load_full

    path = SHARDED_VICTIMS[victim](sharded)
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    corrupt_error(lambda: load_full(str(sharded)), path.name, kind)
    corrupt_error(lambda: GoCkptStorageReader(str(sharded), verify=False).read_metadata(),
                  path.name, kind)


def test_converting_a_sharded_checkpoint_with_a_shard_linked_to_dev_zero_fails(sharded, tmp_path):
    from gockpt.convert import open_source

    shard = _part_shard(sharded)
    shard.unlink()
    shard.symlink_to("/dev/zero")
    corrupt_error(lambda: open_source(str(sharded)), shard.name, "symbolic link")


def _relist(path, name):
    """Record ``name``'s new size and checksum in the global manifest of the checkpoint."""
    import xxhash

    data = (path / name).read_bytes()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_part_name_leaving_the_checkpoint_is_refused(sharded):
    from gockpt.dcp import GoCkptStorageReader

    index = json.loads((sharded / "sharded.json").read_text())
    index["parts"][0]["name"] = "../ck/rank-00000"  # the very same part, reached through ".."
    (sharded / "sharded.json").write_text(json.dumps(index))
    _relist(sharded, "sharded.json")
    corrupt_error(lambda: GoCkptStorageReader(str(sharded)).read_metadata(), "sharded.json",
                  "'../ck/rank-00000'")


@pytest.mark.parametrize("index", ['{"parts": 3}', '{"parts": [7]}', '{"a": 1, "a": 2}'])
def test_verify_reports_a_malformed_sharded_index_as_a_problem(sharded, index):
    from gockpt.audit import verify_checkpoint

    (sharded / "sharded.json").write_text(index)
    _relist(sharded, "sharded.json")  # the checksum matches: the content is what is wrong
    problems = verify_checkpoint(str(sharded), load=False)
    assert problems and all("sharded.json" in p.file for p in problems), problems


def test_a_sharding_file_is_decoded_strictly(sharded):
    from gockpt.dcp import load_full

    name = "rank-00000.sharding.json"
    text = (sharded / name).read_text()
    assert text.startswith('{"aliases": {}')
    (sharded / name).write_text('{"aliases": {}, "aliases": {}' + text[len('{"aliases": {}'):])
    _relist(sharded, name)
    corrupt_error(lambda: load_full(str(sharded)), name, "duplicate JSON key 'aliases'")


def test_a_sharding_file_not_matching_the_global_manifest_is_refused(sharded):
    from gockpt.dcp import load_full

    name = "rank-00000.sharding.json"
    (sharded / name).write_bytes((sharded / name).read_bytes() + b" " * 64)
    corrupt_error(lambda: load_full(str(sharded)), name, "manifest says")


def test_a_missing_part_directory_is_a_corrupt_checkpoint(sharded):
    """A complete index naming a part that is not there: damage, not "no checkpoint"."""
    import shutil

    from gockpt.dcp import load_full, load_parts

    shutil.rmtree(sharded / "rank-00000")
    for read in (lambda: load_full(str(sharded)), lambda: load_parts(str(sharded), verify=False)):
        corrupt_error(read, "rank-00000", "missing")


def test_a_part_directory_linked_out_of_the_checkpoint_is_refused(sharded, tmp_path):
    """``rank-00000`` a symlink to an intact copy elsewhere: the files it holds would pass
    every check, but a checkpoint reads only what is inside it."""
    from gockpt import cli
    from gockpt.audit import describe_checkpoint, verify_checkpoint
    from gockpt.dcp import load_full, load_parts

    outside = tmp_path / "outside"
    (sharded / "rank-00000").rename(outside)
    (sharded / "rank-00000").symlink_to(outside, target_is_directory=True)
    for read in (lambda: load_full(str(sharded)), lambda: load_parts(str(sharded), verify=False),
                 lambda: describe_checkpoint(str(sharded))):
        corrupt_error(read, "rank-00000", "symbolic link")
    problems = verify_checkpoint(str(sharded))
    assert problems and "symbolic link" in problems[0].message, problems
    assert cli.main(["convert", str(sharded), str(tmp_path / "hf"), "--to", "hf"]) == 1
    assert not (tmp_path / "hf").exists()


def test_a_part_shard_with_a_crafted_header_is_refused_before_safetensors_reads_it(sharded, tmp_path):
    """A header length past the file, with the checksums in both manifests recomputed to match:
    reading the sharded checkpoint fails naming the shard, never with safetensors' own error."""
    import xxhash

    from gockpt import cli
    from gockpt.dcp import load_full

    shard = _part_shard(sharded)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 62)
    shard.write_bytes(bytes(data))
    part = sharded / "rank-00000"
    manifest = json.loads((part / "manifest.json").read_text())
    manifest["files"][shard.name]["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(data))
    (part / "manifest.json").write_text(json.dumps(manifest))
    text = (part / "manifest.json").read_bytes()
    index = json.loads((sharded / "sharded.json").read_text())
    index["parts"][0].update(manifest_bytes=len(text), manifest_xxh3_64=xxhash.xxh3_64_hexdigest(text))
    (sharded / "sharded.json").write_text(json.dumps(index))
    _relist(sharded, "sharded.json")
    corrupt_error(lambda: load_full(str(sharded)), shard.name, "overruns")
    for to in ("hf", "dcp"):
        assert cli.main(["convert", str(sharded), str(tmp_path / to), "--to", to]) == 1
        assert not (tmp_path / to).exists()


def test_a_sharded_checkpoint_cut_short_before_its_commit_is_no_checkpoint(sharded, tmp_path):
    """Each part is a complete directory of its own, but only a rank's share: neither a scan
    for the newest checkpoint nor the CLI may take one for the whole checkpoint."""
    from gockpt import cli
    from gockpt.convert import open_source

    (sharded / "manifest.json").unlink()  # the commit never happened
    assert latest_checkpoint(str(sharded)) is None
    assert not is_complete(str(sharded))
    out = tmp_path / "hf"
    for argv in (["verify", str(sharded)], ["convert", str(sharded), str(out), "--to", "hf"]):
        assert cli.main(argv) == 1, argv
    assert not out.exists()
    part = sharded / "rank-00000"
    assert is_complete(str(part))  # a part is complete in itself ...
    with pytest.raises(ValueError, match="one rank's part of a sharded checkpoint"):
        open_source(str(part))  # ... but never converted as if it were the model
    assert cli.main(["convert", str(part), str(out), "--to", "hf"]) == 1
    assert not out.exists()


# --- Accelerate folders: every file read bounded, regular files only -------------------------


@pytest.fixture
def accelerate_folder(tmp_path):
    import safetensors.torch

    folder = tmp_path / "acc"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.arange(6.0)}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.bin")
    return folder


@pytest.mark.parametrize("kind", ["FIFO", "symbolic link"])
@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.bin"])
def test_an_accelerate_folder_refuses_fifos_and_links_to_dev_zero(accelerate_folder, victim, kind):
    from gockpt.convert import open_source

    assert open_source(str(accelerate_folder)).model_state_dict["w"].tolist() == list(range(6))
    path = accelerate_folder / victim
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    corrupt_error(lambda: open_source(str(accelerate_folder)), victim, kind)


def test_an_undecodable_accelerate_model_names_the_file(accelerate_folder):
    from gockpt.convert import open_source

    (accelerate_folder / "model.safetensors").write_bytes(b"\0" * 64)
    corrupt_error(lambda: open_source(str(accelerate_folder)), "model.safetensors",
                  "not a safetensors file")


def test_verify_without_checksums_checks_each_shard_header(ckpt):
    # Sizes unchanged: only reading the header (locally or through fsspec) tells these apart.
    from gockpt.audit import verify_checkpoint

    store, manifest = ckpt
    shard = next(n for n in manifest["files"] if n.endswith(".safetensors"))
    path = store.fs_path("ckpt", shard)
    good = store.fs.cat_file(path)
    n = int.from_bytes(good[:8], "little")
    at = good.index(b'"shape":[', 8, 8 + n) + len(b'"shape":[')
    assert good[at:at + 1].isdigit()
    reshaped = bytearray(good)
    reshaped[at] = ord("1") if good[at:at + 1] != b"1" else ord("2")
    overlong = bytearray(good)
    overlong[:8] = (len(good) + 1).to_bytes(8, "little")
    assert verify_checkpoint(store.path("ckpt"), load=False, checksums=False) == []
    for bad, fragment in ((reshaped, "shape"), (overlong, "overruns the file")):
        store.fs.pipe_file(path, bytes(bad))
        problems = verify_checkpoint(store.path("ckpt"), load=False, checksums=False)
        assert [p.file.rpartition("/")[2] for p in problems] == [shard]
        assert fragment in problems[0].message, problems[0].message


@pytest.mark.parametrize("edit", ["global shape larger", "replica", "overlapping chunks"])
def test_sharded_chunks_must_tile_each_tensor(sharded, edit, tmp_path):
    # The sharding file's checksum is recorded again: only its content is wrong. A tensor the
    # stored chunks do not cover whole would load with unread (uninitialised) elements.
    from gockpt.audit import verify_checkpoint
    from gockpt.cli import main
    from gockpt.dcp import load_full

    sharding = json.loads((sharded / "rank-00000.sharding.json").read_text())
    tensors = sharding["tensors"]
    key = next(k for k, i in tensors.items() if i["fqn"] == "model.0.bias")
    if edit == "global shape larger":
        tensors[key]["global_shape"] = [64]
        fragment = "elements"
    elif edit == "replica":
        tensors[key]["replica"] = 1
        fragment = "first replica"
    else:  # with the second layer's bias (2 elements) as a chunk of the first's: 3 + 2 of 5
        other = next(k for k, i in tensors.items() if i["fqn"] == "model.1.bias")
        tensors[other].update(fqn="model.0.bias", global_shape=[5], offsets=[1])
        tensors[key]["global_shape"] = [5]
        fragment = "overlap"
    (sharded / "rank-00000.sharding.json").write_text(json.dumps(sharding))
    _relist(sharded, "rank-00000.sharding.json")
    corrupt_error(lambda: load_full(str(sharded)), "rank-00000.sharding.json", "model.0.bias", fragment)
    problems = verify_checkpoint(str(sharded))
    assert problems and any(fragment in p.message for p in problems), problems
    out = tmp_path / "out"
    assert main(["convert", str(sharded), str(out), "--to", "hf"]) != 0
    assert not out.exists()


def test_the_cli_dates_a_sharded_checkpoint_and_names_a_part_as_one(sharded, capsys):
    from gockpt.cli import main

    assert main(["inspect", str(sharded)]) == 0
    out = capsys.readouterr().out
    assert "created" in out and "unknown" not in out, out
    part = str(sharded / "rank-00000")
    assert main(["inspect", part]) == 0
    assert "one rank's part of a sharded checkpoint" in capsys.readouterr().out
    assert main(["verify", part]) == 0
    assert "one rank's part of a sharded checkpoint" in capsys.readouterr().out
    out = sharded.parent / "out.ckpt"
    assert main(["convert", str(sharded), str(out), "--to", "lightning"]) == 1
    assert "sharded tensors" in capsys.readouterr().err and not out.exists()


# --- the pickled state tree: shared, cyclic and self-holding containers ---------------------


def _load_within(path, timeout_s=30.0, **kw):
    """``load_checkpoint(path)`` on a thread: its result, or a failure if it runs past the bound."""
    out = {}

    def run():
        try:
            out["state"] = load_checkpoint(path, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"load_checkpoint still running after {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out["state"]


def test_a_state_tree_of_shared_lists_loads_as_pickled_without_expanding(tmp_path):
    """64 levels of ``L = [L, L]``: a few hundred bytes pickled, 2**64 paths. It loads at once,
    the sharing kept (it used to be expanded path by path, without bound in time and memory)."""
    from gockpt.snapshot import save_tree

    deep: list = []
    for _ in range(64):
        deep = [deep, deep]
    save_tree(str(tmp_path / "ck"), {"deep": deep, "w": torch.ones(2)})
    extra = _load_within(str(tmp_path / "ck")).extra
    got = extra["deep"]
    for _ in range(64):
        assert len(got) == 2 and got[0] is got[1]
        got = got[0]
    assert got == [] and torch.equal(extra["w"], torch.ones(2))


def test_a_state_tree_that_holds_itself_loads_with_its_cycle(tmp_path):
    """A list and a dict that contain themselves (``torch.save`` keeps such cycles): saved and
    loaded with the cycle, not a RecursionError."""
    from gockpt.snapshot import save_tree

    loop: list = [1]
    loop.append(loop)
    node: dict = {"w": torch.arange(3.0)}
    node["self"] = node
    save_tree(str(tmp_path / "ck"), {"loop": loop, "node": node})
    extra = _load_within(str(tmp_path / "ck")).extra
    assert extra["loop"][0] == 1 and extra["loop"][1] is extra["loop"]
    assert extra["node"]["self"] is extra["node"] and torch.equal(extra["node"]["w"], torch.arange(3.0))


def test_a_state_tree_whose_tuple_holds_itself_is_a_corrupt_checkpoint(tmp_path):
    """A tuple inside its own list (unpickled only with ``allow_pickle``): no copy of the tree
    can hold that cycle; the load names the checkpoint (CheckpointCorruptError), never a raw
    RecursionError."""
    import io

    import xxhash

    from gockpt.snapshot import save_tree

    path = tmp_path / "ck"
    save_tree(str(path), {"w": torch.ones(2)})
    manifest = json.loads((path / "manifest.json").read_text())
    name = manifest["extra_file"]
    blob = torch.load(path / name, weights_only=True)
    inner: list = []
    cyc = (inner,)
    inner.append(cyc)
    blob["user"] = {"cyc": cyc}
    buf = io.BytesIO()
    torch.save(blob, buf)
    data = buf.getvalue()
    (path / name).write_bytes(data)
    manifest["files"][name] = {**manifest["files"][name], "bytes": len(data),
                               "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="tuple that contains itself"):
        _load_within(str(path), allow_pickle=True)
