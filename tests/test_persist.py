"""persist(): round trip, atomic replace, cancel, failures, superseded saves, parallel writes."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading

import pytest
import torch

import gockpt
from gockpt.errors import CheckpointStorageError
from gockpt.load import read_checkpoint
from gockpt.persist import CheckpointCancelledError, persist
from gockpt.storage import is_complete, latest_checkpoint
from gockpt.targets import LocalTarget


def assert_loads_as(path, tensors, step, storage_options=None):
    loaded = read_checkpoint(path, storage_options=storage_options)
    assert loaded.manifest["meta"]["captured_step"] == step
    assert loaded.extra == {"step": step}
    for key, want in tensors.items():
        got = loaded.tensors[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
    return loaded


def snapshot(store):
    """Everything a save could leave behind: the store's entries and the checkpoint's."""
    return store.listing(), store.listing("ckpt")


def test_round_trip_equals(store, make_request, make_tensors):
    tensors = make_tensors(1)
    req = make_request(
        store.path("ckpt"), tensors, step=5, aliases={"head.weight": "emb"}, num_io_threads=3
    )
    assert len(req.shards) > 2
    result = persist(req)

    assert result.published
    loaded = assert_loads_as(store.path("ckpt"), tensors, 5)
    assert loaded.tensors["head.weight"] is loaded.tensors["emb"]
    assert loaded.manifest["files"] == result.files
    manifest_bytes = len(store.fs.cat_file(store.fs_path("ckpt", "manifest.json")))
    assert result.bytes_written == sum(f["bytes"] for f in result.files.values()) + manifest_bytes
    assert sorted(store.listing("ckpt")) == sorted([*result.files, "manifest.json"])
    assert store.listing() == ["ckpt", "latest"]
    assert latest_checkpoint(store.root) == store.path("ckpt")


def test_single_thread_and_one_big_chunk_give_identical_files(store, make_request, make_tensors):
    tensors = make_tensors(2)
    a = make_request(store.path("a"), tensors, num_io_threads=1, chunk_bytes=1 << 20)
    b = make_request(store.path("b"), tensors, num_io_threads=4, chunk_bytes=7)
    b.shards, b.slot, b.shard_bases, b.extra = a.shards, a.slot, a.shard_bases, a.extra
    ra, rb = persist(a), persist(b)
    digests = lambda r: sorted((f["bytes"], f["xxh3_64"]) for f in r.files.values())  # noqa: E731
    assert digests(ra) == digests(rb)


def test_resave_same_path_replaces_atomically(store, make_request, make_tensors):
    old, new = make_tensors(1), make_tensors(2)
    persist(make_request(store.path("ckpt"), old, step=1))
    seen_before_swap = []

    def still_old() -> bool:
        # Called under the publish lock right before the swap: the old checkpoint is intact.
        seen_before_swap.append(assert_loads_as(store.path("ckpt"), old, 1).manifest)
        return False

    result = persist(make_request(store.path("ckpt"), new, step=2, is_superseded=still_old))

    assert result.published and len(seen_before_swap) == 1
    assert_loads_as(store.path("ckpt"), new, 2)
    assert sorted(store.listing("ckpt")) == sorted([*result.files, "manifest.json"])
    assert store.listing() == ["ckpt", "latest"]


def test_cancel_mid_shard_leaves_no_files_and_keeps_previous(
    faulty_store, make_request, make_tensors
):
    store, fault = faulty_store
    old = make_tensors(1)
    persist(make_request(store.path("ckpt"), old, step=1))
    before = snapshot(store)
    req = make_request(store.path("ckpt"), make_tensors(2), step=2, num_io_threads=2)
    # The first chunk written sets cancel: the save is then mid-shard.
    fault.hook = lambda name, nbytes: req.cancel.set()

    with pytest.raises(CheckpointCancelledError, match="cancelled"):
        persist(req)

    assert fault.written > 0
    assert snapshot(store) == before
    assert_loads_as(store.path("ckpt"), old, 1)
    assert latest_checkpoint(store.root) == store.path("ckpt")


def test_cancel_before_start_writes_nothing(store, make_request, make_tensors):
    req = make_request(store.path("ckpt"), make_tensors(1))
    req.cancel.set()
    with pytest.raises(CheckpointCancelledError):
        persist(req)
    assert not is_complete(store.path("ckpt"))
    assert store.listing("ckpt") == []
    assert [n for n in store.listing() if n != "ckpt"] == []


@pytest.mark.parametrize(
    "error",
    [RuntimeError("injected storage failure"), OSError(errno.ENOSPC, "No space left on device")],
    ids=["runtime", "enospc"],
)
def test_failed_write_leaves_no_manifest_and_keeps_previous(
    faulty_store, make_request, make_tensors, error
):
    store, fault = faulty_store
    old = make_tensors(1)
    persist(make_request(store.path("ckpt"), old, step=1))
    persist(make_request(store.path("other"), old, step=0, update_latest=False))
    before = snapshot(store)
    fault.raise_after(error, after_bytes=150)
    req = make_request(store.path("ckpt"), make_tensors(2), step=2)

    with pytest.raises(type(error)) as info:
        persist(req)

    # The original error, typed, with the checkpoint and the file named and the cause kept.
    assert isinstance(info.value, CheckpointStorageError) and info.value.__cause__ is error
    assert req.path in str(info.value) and ".safetensors" in str(info.value.filename)
    assert info.value.path == req.path
    if isinstance(error, OSError):
        assert info.value.errno == errno.ENOSPC
    assert snapshot(store) == before
    assert_loads_as(store.path("ckpt"), old, 1)
    assert latest_checkpoint(store.root) == store.path("ckpt")

    # A failed first save of a new path leaves nothing at all.
    fault.raise_after(error, after_bytes=150)
    with pytest.raises(type(error)):
        persist(make_request(store.path("fresh"), make_tensors(3), step=3))
    assert store.listing("fresh") == [] and snapshot(store) == before


def test_superseded_save_is_discarded(store, make_request, make_tensors):
    old = make_tensors(1)
    persist(make_request(store.path("ckpt"), old, step=1))
    before = snapshot(store)
    published = []
    req = make_request(
        store.path("ckpt"),
        make_tensors(2),
        step=9,
        is_superseded=lambda: True,
        on_published=lambda: published.append(True),
    )

    result = persist(req)

    assert not result.published and published == []
    assert snapshot(store) == before
    assert_loads_as(store.path("ckpt"), old, 1)
    pointer = json.loads(store.fs.cat_file(store.fs_path("latest")))
    assert pointer == {"name": "ckpt", "captured_step": 1, "run": 0}


def test_publish_callbacks_run_under_the_publish_lock(store, make_request, make_tensors):
    lock = threading.Lock()
    calls = []
    req = make_request(
        store.path("ckpt"),
        make_tensors(1),
        publish_lock=lock,
        is_superseded=lambda: (
            calls.append(("superseded", lock.locked(), is_complete(store.path("ckpt")))) or False
        ),
        on_published=lambda: calls.append(
            ("published", lock.locked(), is_complete(store.path("ckpt")))
        ),
    )
    persist(req)
    assert calls == [("superseded", True, False), ("published", True, True)]
    assert not lock.locked()


def test_io_threads_write_shards_concurrently(faulty_store, make_request, make_tensors):
    store, fault = faulty_store
    barrier = threading.Barrier(2, timeout=20)
    waited: set[str] = set()
    guard = threading.Lock()

    def meet(name: str, nbytes: int) -> None:
        # The first two shard files each wait for the other: this only passes if two
        # threads are writing at the same time (a serial writer breaks the barrier).
        with guard:
            first = name not in waited and len(waited) < 2
            waited.add(name)
        if first:
            barrier.wait()

    fault.hook = meet
    req = make_request(store.path("ckpt"), make_tensors(1), num_io_threads=2)
    assert len(req.shards) >= 3
    persist(req)
    assert len(waited) == len(req.shards)
    read_checkpoint(store.path("ckpt"))


def test_bad_requests_fail_before_writing(store, make_request, make_tensors):
    tensors = make_tensors(1)
    req = make_request(store.path("ckpt"), tensors)
    req.slot = req.slot[:-1].clone()
    with pytest.raises(ValueError, match="outside the slot"):
        persist(req)
    with pytest.raises(ValueError, match="alias"):
        persist(make_request(store.path("ckpt"), tensors, aliases={"x": "missing"}))
    req = make_request(store.path("ckpt"), tensors)
    req.meta["bad"] = object()
    with pytest.raises(TypeError):
        persist(req)
    req = make_request(store.path("ckpt"), tensors)
    req.meta["error"] = float("inf")  # the manifest is read back with Infinity refused
    with pytest.raises(ValueError, match="JSON compliant"):
        persist(req)
    req = make_request(store.path("ckpt"), tensors)
    del req.meta["captured_step"]
    with pytest.raises(ValueError, match="captured_step"):
        persist(req)
    assert store.listing() == []


def test_object_store_rejects_reused_shard_names(make_request, make_tensors):
    import uuid

    path = f"memory://gockpt-test-{uuid.uuid4().hex}/ckpt"
    req = make_request(path, make_tensors(1), step=1)
    persist(req)
    again = make_request(path, make_tensors(2), step=2)
    again.shards, again.slot, again.shard_bases = req.shards, req.slot, req.shard_bases
    with pytest.raises(ValueError, match="unique per save"):
        persist(again)
    assert_loads_as(path, make_tensors(1), 1)


# --- local filesystem specifics -------------------------------------------------------------


def test_local_symlink_at_path_is_replaced_not_written_through(
    tmp_path, make_request, make_tensors
):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("untouched")
    link = tmp_path / "ckpts" / "last"
    link.parent.mkdir()
    link.symlink_to(target)

    persist(make_request(str(link), make_tensors(1), step=3))

    assert not link.is_symlink() and link.is_dir()
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert_loads_as(str(link), make_tensors(1), 3)
    assert sorted(os.listdir(link.parent)) == ["last", "latest"]


def test_local_regular_file_at_path_is_replaced(tmp_path, make_request, make_tensors):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"an old torch.save file")
    persist(make_request(str(path), make_tensors(1), step=3))
    assert_loads_as(str(path), make_tensors(1), 3)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "latest"]


class _NoExchange(LocalTarget):
    """A local filesystem without renameat2(RENAME_EXCHANGE), through the public target seam."""

    @staticmethod
    def exchange(a, b):
        return False


def test_local_resave_without_atomic_exchange(tmp_path, make_request, make_tensors):
    path = str(tmp_path / "ckpt")

    def target(fs, root, names, timeout_s):
        return _NoExchange(fs, root)

    persist(make_request(path, make_tensors(1), step=1, target_factory=target))
    persist(make_request(path, make_tensors(2), step=2, target_factory=target))
    assert_loads_as(path, make_tensors(2), 2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "latest"]


def test_local_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    if not LocalTarget.exchange(str(a), str(b)):
        pytest.fail("renameat2(RENAME_EXCHANGE) is unavailable on this Linux host")
    assert (b / "x").read_text() == "from a" and not (a / "x").exists()


def test_local_parent_directories_are_created(tmp_path, make_request, make_tensors):
    path = str(tmp_path / "a" / "b" / "ckpt")
    persist(make_request(path, make_tensors(1), step=1))
    assert_loads_as(path, make_tensors(1), 1)


# --- S3 over a loopback endpoint ---------------------------------------------------------------


def test_s3_multi_shard_round_trip_and_resave(s3_store, make_request, make_tensors):
    opts = s3_store.storage_options
    path = s3_store.path("ckpt")
    old, new = make_tensors(1), make_tensors(2)
    first = persist(make_request(path, old, step=1, storage_options=opts, num_io_threads=3))
    assert sum(name.endswith(".safetensors") for name in first.files) > 2
    assert_loads_as(path, old, 1, opts)

    second = persist(make_request(path, new, step=2, storage_options=opts))
    assert_loads_as(path, new, 2, opts)
    # The files of the replaced checkpoint are gone, the new ones and the manifest remain.
    assert sorted(s3_store.listing("ckpt")) == sorted([*second.files, "manifest.json"])
    assert latest_checkpoint(s3_store.root, opts) == path


@pytest.mark.parametrize("slow", [True, False])
def test_checkpoints_requested_faster_than_storage_persists_them_are_warned_once(
        tmp_path, monkeypatch, caplog, slow):
    # Every shard write waits 0.2 s (a slow store): each request at every step finds the save
    # before still writing its host slot, and waits, as predicted from the pace of the
    # persists before it. With fast storage and steps that outlast a persist, no request
    # waits, none is predicted, and nothing is said.
    import time

    import faultfs
    from _loop import make

    fault = faultfs.Fault(hook=(lambda name, nbytes: time.sleep(0.2)) if slow else None,
                          match=".safetensors")
    monkeypatch.setattr(faultfs.FaultLocalFileSystem, "fault", fault)
    model, opt, _, _ = make()
    eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="lazy"))
    handles = []
    with caplog.at_level(logging.WARNING, logger="gockpt"):
        for r in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            eng.step_end()
            handles.append(eng.save(faultfs.local_url(tmp_path / f"ckpt{r}")))
            if not slow:
                eng.wait()  # the next step starts once this checkpoint is written
        eng.close()
    ms = [h.result() for h in handles]
    waits = [m.stall_by_phase_s.get("slot_wait", 0.0) for m in ms]
    predicted = [m.predicted_slot_wait_s for m in ms]
    said = [r for r in caplog.records if "faster than storage persists them" in r.getMessage()]
    if slow:
        assert all(w > 0.05 for w in waits[1:]), waits
        assert len(said) == 1 and "3 checkpoints in a row" in said[0].getMessage()
        # It says how long one checkpoint takes to write out: at least the store's 0.2 s.
        took = re.search(r"Each takes about ([\d.]+) s to write out", said[0].getMessage())
        assert took and float(took.group(1)) >= 0.2, said[0].getMessage()
        # And how much it writes: a small checkpoint is not rounded down to "0 MB".
        size = re.search(r"\(([\d.e+-]+) MB at ([\d.e+-]+) MB/s\)", said[0].getMessage())
        assert size and float(size.group(1)) > 0 and float(size.group(2)) > 0, said[0].getMessage()
        # From the third on, a persist before has written everything: its pace predicts the
        # wait. Broad bounds: the pace is the store's sleeps, but when the request comes into
        # the persist it waits for (a slow step) is this machine's.
        for m, w, p in list(zip(ms, waits, predicted))[2:]:
            assert m.slot_borrowed and 0.3 * w <= p <= 3 * w, (waits, predicted)
            assert m.predicted_stall_s >= p
    else:
        assert said == [], waits
        assert predicted == [0.0] * len(ms)


def test_a_reused_file_is_linked_its_ranges_freed_apart_from_the_pace_and_a_changed_one_written(
        tmp_path, make_request):
    """``PersistRequest.reuse``: a shard whose origin is the very file published before is
    hard-linked (not written, not counted in ``bytes_written``), its slot ranges reported
    through ``on_chunk_linked``, and the checkpoint loads; an origin modified since is
    written instead."""
    from gockpt.persist import slot_chunks

    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(8)}  # two shards
    req = make_request(str(tmp_path / "a0"), tensors)
    assert persist(req).origins == {}  # none asked for
    req = make_request(str(tmp_path / "a"), tensors)
    req.origins_of = {sh.file for sh in req.shards}
    first = persist(req)
    assert first.published and first.bytes_linked == 0
    assert set(first.origins) == {sh.file for sh in req.shards}
    origin = first.origins[req.shards[0].file]

    req = make_request(str(tmp_path / "b"), tensors)
    assert len(req.shards) == 2
    name = req.shards[0].file  # another name: the link gets this save's
    req.reuse = {name: origin}
    req.origins_of = {name}
    calls: dict[str, list] = {"read": [], "linked": []}
    req.on_chunk_read = lambda b, e: calls["read"].append((b, e))
    req.on_chunk_linked = lambda b, e: calls["linked"].append((b, e))
    second = persist(req)
    assert second.bytes_linked == req.shards[0].file_bytes
    assert os.stat(tmp_path / "b" / name).st_ino == origin.ino
    assert calls["linked"] == list(slot_chunks(req)[0])
    assert calls["read"] == [r for f in slot_chunks(req)[1:] for r in f]
    assert second.files[name] == first.files[origin.path.rsplit("/", 1)[1]]  # bytes, digest
    written = sum(f["bytes"] for n, f in second.files.items() if n != name)
    assert written < second.bytes_written < written + 4096  # the others and the manifest
    assert_loads_as(str(tmp_path / "b"), tensors, 1)
    gockpt.remove_checkpoint(str(tmp_path / "a"))
    assert_loads_as(str(tmp_path / "b"), tensors, 1)  # whole without the one it linked from

    # Modified since (its modification time moved): written, not linked.
    origin = second.origins[name]
    st = os.stat(origin.path)
    os.utime(origin.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    req = make_request(str(tmp_path / "c"), tensors)
    req.reuse = {req.shards[0].file: origin}
    third = persist(req)
    assert third.bytes_linked == 0
    assert os.stat(tmp_path / "c" / req.shards[0].file).st_ino != origin.ino
    assert_loads_as(str(tmp_path / "c"), tensors, 1)
