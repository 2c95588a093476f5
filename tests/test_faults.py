"""Storage faults through public seams: an S3 endpoint behind a fault-injecting proxy, fsspec
filesystems that fail or stall (tests/faultfs.py), and a small tmpfs that really fills up.

What must hold: a failed save raises the original error, typed, naming the checkpoint and file,
with its cause; it leaves no objects and no multipart uploads behind; the previous checkpoint is
intact; waits are bounded; a checkpoint that was published is never reported as failed because
moving ``latest`` failed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import subprocess
import threading
import time
import uuid

import faultfs
import pytest
import torch
from conftest import Store
from s3proxy import FaultProxy

import gockpt
from gockpt.errors import CheckpointStorageError, CheckpointTimeoutError
from gockpt.load import read_checkpoint
from gockpt.persist import persist
from gockpt.storage import claim_directory, has_manifest, is_complete, latest_checkpoint, url_to_fs

# Generous upper bound on any failing save below (the defaults would take minutes).
BOUND_S = 30.0


def assert_loads_as(path, tensors, step, storage_options=None):
    loaded = read_checkpoint(path, storage_options=storage_options)
    assert loaded.manifest["meta"]["captured_step"] == step
    for key, want in tensors.items():
        assert torch.equal(loaded.tensors[key], want), key


# --- S3 behind a fault-injecting proxy ----------------------------------------------------------


@pytest.fixture
def s3(_moto_endpoint, monkeypatch):
    """(store, proxy, client): a fresh bucket reached through a :class:`FaultProxy`; ``client`` is
    a boto3 client straight to moto (it sees what is really left in the bucket)."""
    import boto3
    import s3fs

    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"gockpt-{uuid.uuid4().hex[:16]}"
    s3fs.S3FileSystem(key="testing", secret="testing",
                      client_kwargs={"endpoint_url": _moto_endpoint}).mkdir(bucket)
    proxy = FaultProxy(_moto_endpoint)
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": proxy.url},
        "default_block_size": 5 << 20,  # S3's smallest part: multipart uploads for big shards
    }
    client = boto3.client("s3", endpoint_url=_moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    yield Store(f"s3://{bucket}/ckpts", storage_options=options, kind="s3"), proxy, client
    proxy.close()


def bucket_state(store, client):
    """(object keys, keys of unfinished multipart uploads) of the store's bucket."""
    bucket = store.root.removeprefix("s3://").partition("/")[0]
    objects = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return sorted(o["Key"] for o in objects), sorted(u["Key"] for u in uploads)


def big_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    # 12 MiB in one shard: a multipart upload of three 5 MiB parts.
    return {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(7, generator=g)}


def save_previous(store, make_request):
    """A complete checkpoint ``ckpt`` at step 1, and what the bucket holds after it."""
    old = {"w": torch.arange(12.0)}
    persist(make_request(store.path("ckpt"), old, step=1, storage_options=store.storage_options))
    return old


def failing_save(store, make_request, timeout_s=None):
    req = make_request(store.path("ckpt"), big_tensors(2), step=2,
                       storage_options=store.storage_options, max_shard_bytes=64 << 20,
                       chunk_bytes=1 << 20, num_io_threads=2)
    if timeout_s is not None:
        req.storage_timeout_s = timeout_s
    t0 = time.monotonic()
    with pytest.raises(CheckpointStorageError) as info:
        persist(req)
    return info.value, time.monotonic() - t0


def is_part(n):
    return lambda method, path: "partNumber=" in path and f"partNumber={n}&" in path + "&"


@pytest.mark.parametrize(
    "action, target",
    [
        ("500", "part 2"),
        ("503", "part 2"),
        ("reset", "part 2"),
        ("500", "small objects"),
        ("reset", "small objects"),
    ],
)
def test_s3_failed_save_leaves_nothing_and_reports_the_original_error(
    s3, make_request, action, target
):
    store, proxy, client = s3
    old = save_previous(store, make_request)
    before = bucket_state(store, client)
    if target == "part 2":
        rule = is_part(2)
    else:  # single-PUT objects: the non-tensor state blob and small shards
        def rule(method, path):
            return method == "PUT" and "state-" in path and "uploadId" not in path
    proxy.rule = lambda method, path: action if rule(method, path) else None

    error, elapsed = failing_save(store, make_request)

    assert elapsed < BOUND_S
    assert proxy.count(action) >= 1
    assert not isinstance(error, CheckpointTimeoutError)
    assert store.path("ckpt") in str(error) and error.path == store.path("ckpt")
    assert error.__cause__ is not None
    # The save's own objects and its multipart upload are gone; the previous checkpoint stays.
    proxy.rule = None
    assert bucket_state(store, client) == before
    assert before[1] == []
    assert_loads_as(store.path("ckpt"), old, 1, store.storage_options)
    assert latest_checkpoint(store.root, store.storage_options) == store.path("ckpt")


def test_s3_slowdown_is_retried_a_bounded_number_of_times(s3, make_request):
    store, proxy, client = s3
    save_previous(store, make_request)
    seen = []

    def two_slowdowns(method, path):
        if "partNumber=1&" in path + "&":
            seen.append(path)
            return "503" if len(seen) <= 2 else None
        return None

    proxy.rule = two_slowdowns
    tensors = big_tensors(3)
    persist(make_request(store.path("ckpt"), tensors, step=3, storage_options=store.storage_options,
                         max_shard_bytes=64 << 20, chunk_bytes=1 << 20))
    assert proxy.count("503") == 2
    assert_loads_as(store.path("ckpt"), tensors, 3, store.storage_options)

    # Permanent SlowDown: each request is tried a bounded number of times, then the save fails.
    proxy.requests.clear()
    proxy.rule = lambda method, path: "503" if is_part(2)(method, path) else None
    error, elapsed = failing_save(store, make_request)
    assert elapsed < BOUND_S
    assert 1 <= proxy.count("503") <= 3
    assert "SlowDown" in str(error) or "503" in str(error) or "reduce" in str(error).lower()
    proxy.rule = None
    assert bucket_state(store, client)[1] == []


def test_s3_hung_endpoint_fails_within_the_storage_deadline(s3, make_request):
    store, proxy, client = s3
    old = save_previous(store, make_request)
    before = bucket_state(store, client)
    proxy.rule = lambda method, path: "hang"

    error, elapsed = failing_save(store, make_request, timeout_s=1.0)

    # Writes, the abort and the clean-up each give up after about storage_timeout_s.
    assert elapsed < BOUND_S
    assert isinstance(error, CheckpointTimeoutError) and isinstance(error, TimeoutError)
    assert store.path("ckpt") in str(error)
    proxy.rule = None
    assert bucket_state(store, client) == before
    assert_loads_as(store.path("ckpt"), old, 1, store.storage_options)


def test_s3_manifest_put_answered_late_never_tears_the_checkpoint(s3, make_request):
    """The manifest PUT of a save over a complete checkpoint reaches S3 only after the client
    gave up on it (its reply is late): the save fails, and its files must stay, for the
    manifest that lands later names them. Deleting them on the failure left a manifest naming
    missing files: the only complete checkpoint torn."""
    store, proxy, client = s3
    old = save_previous(store, make_request)
    # Storage calls give up after 3 s: on a loaded machine a data PUT through the proxy once
    # took over the 1 s this used, so the save failed before its manifest was put at all.
    proxy.late_s = 6.0
    proxy.rule = lambda method, path: "late" if method == "PUT" and path.split("?")[0].endswith(
        "/ckpt/manifest.json") else None
    error, _ = failing_save(store, make_request, timeout_s=3.0)
    assert isinstance(error, CheckpointTimeoutError)
    assert proxy.count("late") >= 1, error  # it failed at its manifest, not before
    deadline = time.monotonic() + 60
    while proxy.landed_late < proxy.count("late") and time.monotonic() < deadline:
        time.sleep(0.1)
    proxy.rule = None
    assert proxy.landed_late >= 1
    # The late manifest published the failed save's files: a complete checkpoint of step 2.
    assert is_complete(store.path("ckpt"), store.storage_options)
    loaded = read_checkpoint(store.path("ckpt"), storage_options=store.storage_options)
    if loaded.manifest["meta"]["captured_step"] == 2:
        assert_loads_as(store.path("ckpt"), big_tensors(2), 2, store.storage_options)
    else:  # it had not landed after all: the previous checkpoint, whole
        assert_loads_as(store.path("ckpt"), old, 1, store.storage_options)


@pytest.mark.parametrize("late", ["first try", "every try"])
def test_s3_a_late_manifest_put_never_replaces_a_newer_save(s3, make_request, late):
    """A manifest PUT of save 2 reaches S3 after its client gave up: with only the first try
    late, botocore's retry publishes save 2; with every try late, save 2 fails. Save 3 of the
    same path then publishes and deletes the files of the checkpoint it replaced. The late try
    landing afterwards must not replace save 3's manifest (that named deleted files: the only
    checkpoint torn, though every save had succeeded; or brought back step 2)."""
    store, proxy, client = s3
    save_previous(store, make_request)
    proxy.late_s = 10.0  # well past the retries: each try waits 2 s (a third of 6 s)
    tries = []

    def rule(method, path):
        if method == "PUT" and path.split("?")[0].endswith("/ckpt/manifest.json"):
            tries.append(path)
            if late == "every try" or len(tries) == 1:
                return "late"
        return None

    proxy.rule = rule
    two = make_request(store.path("ckpt"), {"w": torch.full((64,), 2.0)}, step=2,
                       storage_options=store.storage_options)
    two.storage_timeout_s = 6.0  # room for a slow retry on a loaded machine
    if late == "first try":
        persist(two)
    else:
        with pytest.raises(CheckpointStorageError):
            persist(two)
    proxy.rule = None
    three = {"w": torch.full((64,), 3.0)}
    persist(make_request(store.path("ckpt"), three, step=3, storage_options=store.storage_options))
    deadline = time.monotonic() + 60
    while proxy.landed_late < proxy.count("late") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proxy.landed_late == proxy.count("late") >= 1
    assert_loads_as(store.path("ckpt"), three, 3, store.storage_options)


def test_s3_a_late_pointer_put_never_moves_latest_back(s3, make_request):
    """The first try of step 2's ``latest`` put reaches S3 after its client gave up; the retry
    moves the pointer, step 3 moves it on. The late try landing afterwards must not move it
    back to step 2 (a resume would lose a checkpoint's progress)."""
    store, proxy, _ = s3
    tries = []

    def rule(method, path):
        if method == "PUT" and path.split("?")[0].endswith("/ckpts/latest"):
            tries.append(path)
            return "late" if len(tries) == 1 else None  # step 2's first try
        return None

    proxy.late_s = 10.0
    for step in (1, 2, 3):
        if step == 2:
            proxy.rule = rule
        req = make_request(store.path(f"step-{step}"), {"w": torch.full((8,), float(step))},
                           step=step, storage_options=store.storage_options)
        req.storage_timeout_s = 6.0
        persist(req)
    proxy.rule = None
    deadline = time.monotonic() + 60
    while proxy.landed_late < proxy.count("late") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proxy.landed_late == proxy.count("late") == 1
    assert latest_checkpoint(store.root, store.storage_options) == store.path("step-3")


def test_s3_conditional_puts_answered_409_or_404_are_put_again(s3, make_request):
    """S3 answers a conditional put that races another write of its key with ``409
    ConditionalRequestConflict`` (botocore does not retry it), and one whose ``If-Match`` object
    is gone with ``404``: the manifest is put once more, the pointer decided again; every save
    is published and ``latest`` names the newest."""
    store, proxy, _ = s3
    first = {}

    def rule(method, path, headers):
        conditional = "If-Match" in headers or "If-None-Match" in headers
        key = path.split("?")[0]
        if method != "PUT" or not conditional:
            return None
        if key.endswith("/step-2/manifest.json") and not first.get("manifest"):
            first["manifest"] = True
            return "409"
        if key.endswith("/ckpts/latest") and "If-Match" in headers and not first.get("pointer"):
            first["pointer"] = True  # step 2's move of the pointer step 1 put
            return "404"
        return None

    rule.headers = True
    proxy.rule = rule
    for step in (1, 2, 3):
        tensors = {"w": torch.full((8,), float(step))}
        result = persist(make_request(store.path(f"step-{step}"), tensors, step=step,
                                      storage_options=store.storage_options))
        assert result.published and result.latest_error is None, result.latest_error
        assert_loads_as(store.path(f"step-{step}"), tensors, step, store.storage_options)
    assert proxy.count("409") == 1 and proxy.count("404") == 1
    assert latest_checkpoint(store.root, store.storage_options) == store.path("step-3")


def test_s3_removing_the_checkpoint_latest_names_deletes_the_pointer(s3, make_request):
    """On S3 the pointer is not put back to an older checkpoint (a late try of that put could
    land over a later save's pointer): it is deleted, and readers scan."""
    from gockpt.storage import remove_checkpoint

    store, _, client = s3
    for step in (1, 2):
        persist(make_request(store.path(f"s{step}"), {"w": torch.full((8,), float(step))}, step=step,
                             storage_options=store.storage_options))
    remove_checkpoint(store.path("s2"), store.storage_options)
    keys, _ = bucket_state(store, client)
    assert not any(k.endswith("/latest") for k in keys) and not any("/s2/" in k for k in keys)
    assert latest_checkpoint(store.root, store.storage_options) == store.path("s1")
    persist(make_request(store.path("s3"), {"w": torch.full((8,), 3.0)}, step=3,
                         storage_options=store.storage_options))
    assert latest_checkpoint(store.root, store.storage_options) == store.path("s3")
    assert any(k.endswith("/latest") for k in bucket_state(store, client)[0])


def test_s3_a_store_refusing_conditional_puts_still_takes_checkpoints(s3, make_request, caplog):
    """An S3-compatible store without conditional writes answers ``501 NotImplemented`` to a
    put with ``If-Match``/``If-None-Match``: the manifest goes without them (one warning), and
    every save is published as before."""
    store, proxy, _ = s3

    def rule(method, path, headers):
        conditional = "If-Match" in headers or "If-None-Match" in headers
        return "501" if method == "PUT" and conditional else None

    rule.headers = True
    proxy.rule = rule
    with caplog.at_level("WARNING", logger="gockpt"):
        for step in (1, 2):
            tensors = {"w": torch.full((8,), float(step))}
            persist(make_request(store.path("ckpt"), tensors, step=step,
                                 storage_options=store.storage_options))
            assert_loads_as(store.path("ckpt"), tensors, step, store.storage_options)
    assert proxy.count("501") >= 1
    assert "refused a conditional put" in caplog.text


@pytest.mark.parametrize("action", ["500", "reset", "hang"])
def test_s3_a_failed_listing_in_latest_checkpoint_is_named(s3, make_request, action):
    """Without a ``latest`` pointer (the adapters' default) the newest checkpoint is found by
    listing the folder: a failed LIST is GoCkpt's storage error naming the folder, in bound."""
    store, proxy, _ = s3
    save_previous(store, make_request)
    proxy.rule = lambda method, path: action if method == "GET" and "list-type" in path else None
    want = CheckpointTimeoutError if action == "hang" else CheckpointStorageError
    with pytest.raises(want, match="finding the newest checkpoint in") as info:
        latest_checkpoint(store.root + "/none", store.storage_options, timeout_s=3.0)
    assert store.root in str(info.value)


def test_s3_options_the_user_sets_win(_moto_endpoint):
    fs, _ = url_to_fs("s3://b/x", {"key": "k", "secret": "s", "config_kwargs": {"read_timeout": 99},
                                   "client_kwargs": {"endpoint_url": _moto_endpoint}}, 6.0)
    assert fs.config_kwargs["read_timeout"] == 99
    assert fs.config_kwargs["connect_timeout"] == 2.0
    assert fs.config_kwargs["retries"]["total_max_attempts"] == 3 and fs.retries == 1
    fs, _ = url_to_fs("s3://b/x", {"key": "k", "secret": "s",
                                   "client_kwargs": {"endpoint_url": _moto_endpoint}}, None)
    assert "retries" not in fs.config_kwargs


# --- fault-injecting fsspec filesystems -------------------------------------------------------


def test_a_stalled_object_store_write_fails_with_a_timeout(make_request, make_tensors, monkeypatch):
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", faultfs.Fault())
    store = Store(faultfs.memory_root(), kind="memory")
    fault = faultfs.FaultMemoryFileSystem.fault
    old = make_tensors(1)
    persist(make_request(store.path("ckpt"), old, step=1))
    before = store.listing(), store.listing("ckpt")
    fault.hook = lambda name, nbytes: time.sleep(0.3)
    req = make_request(store.path("ckpt"), make_tensors(2), step=2, storage_timeout_s=0.1)

    with pytest.raises(CheckpointTimeoutError, match="storage_timeout_s") as info:
        persist(req)

    assert isinstance(info.value, TimeoutError) and isinstance(info.value, CheckpointStorageError)
    assert req.path in str(info.value)
    fault.hook = None
    assert (store.listing(), store.listing("ckpt")) == before
    assert_loads_as(store.path("ckpt"), old, 1)


def test_a_failing_cleanup_does_not_mask_the_write_error(
    make_request, make_tensors, monkeypatch, caplog
):
    fault = faultfs.Fault()
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    store = Store(faultfs.memory_root(), kind="memory")
    eio = OSError(errno.EIO, "injected I/O error")
    fault.raise_after(eio, after_bytes=150)

    def no_delete(op, path):
        if op == "rm":
            raise PermissionError(errno.EACCES, "DeleteObject denied", path)

    fault.op_hook = no_delete
    with caplog.at_level(logging.WARNING, logger="gockpt"), pytest.raises(CheckpointStorageError) as info:
        persist(make_request(store.path("ckpt"), make_tensors(1), step=1))

    assert info.value.errno == errno.EIO and info.value.__cause__ is eio
    assert "DeleteObject" not in str(info.value)
    assert any("could not delete" in r.getMessage() and "DeleteObject" in r.getMessage()
               for r in caplog.records)


def test_enospc_on_the_pointer_does_not_fail_a_published_save(faulty_store, make_request, make_tensors):
    store, fault = faulty_store
    old, new = make_tensors(1), make_tensors(2)
    persist(make_request(store.path("a"), old, step=1))

    def full(op, path):
        if os.path.basename(path).startswith((".latest.", "latest")) and op in ("open", "pipe"):
            raise OSError(errno.ENOSPC, "No space left on device", path)

    fault.op_hook = full
    with pytest.warns(RuntimeWarning, match=r"latest.*ENOSPC|ENOSPC.*latest") as warned:
        result = persist(make_request(store.path("b"), new, step=2))

    assert result.published and "No space left" in result.latest_error
    assert store.path("b") in str(warned[0].message)
    # The stale pointer was removed: readers scan and find the new checkpoint.
    assert "latest" not in store.listing()
    assert latest_checkpoint(store.root) == store.path("b")
    assert_loads_as(store.path("b"), new, 2)

    # If even removing it fails, the pointer still names the previous, valid checkpoint.
    def full_and_stuck(op, path):
        if os.path.basename(path) == "latest" and op == "rm":
            raise PermissionError(errno.EACCES, "denied", path)
        full(op, path)

    fault.op_hook = None
    persist(make_request(store.path("c"), old, step=3))
    fault.op_hook = full_and_stuck
    with pytest.warns(RuntimeWarning, match="still names the older checkpoint 'c'"):
        assert persist(make_request(store.path("d"), new, step=4)).published
    fault.op_hook = None
    assert latest_checkpoint(store.root) == store.path("c")


def test_enospc_in_a_shard_names_the_file_and_keeps_the_previous(faulty_store, make_request, make_tensors):
    store, fault = faulty_store
    old = make_tensors(1)
    persist(make_request(store.path("ckpt"), old, step=1))
    before = store.listing(), store.listing("ckpt")
    fault.raise_after(OSError(errno.ENOSPC, "No space left on device"), after_bytes=300)

    with pytest.raises(CheckpointStorageError) as info:
        persist(make_request(store.path("ckpt"), make_tensors(2), step=2))

    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert store.path("ckpt") in str(info.value) and ".safetensors" in str(info.value)
    fault.hook = None
    assert (store.listing(), store.listing("ckpt")) == before
    assert_loads_as(store.path("ckpt"), old, 1)


# --- a hung object store (no timeout of its own) ---------------------------------------------

# storage_timeout_s in the tests below, and the generous bound each bounded wait must meet.
HUNG_TIMEOUT_S = 1.0
HUNG_BOUND_S = 15.0


@pytest.fixture
def hung_store(monkeypatch):
    """(store, fault, release): an object store (tests/faultfs.py) whose armed calls block until
    ``release`` is set (``fault.hang``); set at teardown, so no test leaves a call hung."""
    fault = faultfs.Fault()
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    release = threading.Event()
    root = faultfs.memory_root()
    try:
        yield Store(root, kind="memory"), fault, release
    finally:
        fault.hook = fault.op_hook = None
        release.set()
        faultfs.clear_memory(root)


def run_bounded(fn, bound_s=HUNG_BOUND_S):
    """(returned, raised, seconds) of ``fn()`` run on a daemon thread; fails the test if it has
    not finished within ``bound_s`` (the hang this bounds would otherwise hang the test)."""
    out = {}

    def call():
        try:
            out["returned"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["raised"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"still waiting after {bound_s:g} s on a hung store"
    return out.get("returned"), out.get("raised"), time.monotonic() - t0


@pytest.mark.parametrize("hung", ["write", "cat", "write+rm"])
def test_a_hung_object_store_fails_the_save_within_the_storage_deadline(
    hung_store, make_request, make_tensors, hung, caplog
):
    store, fault, release = hung_store
    old = make_tensors(1)
    persist(make_request(store.path("ckpt"), old, step=1))
    before = store.listing(), store.listing("ckpt")
    fault.hang(hung.split("+"), release)
    req = make_request(store.path("ckpt"), make_tensors(2), step=2,
                       storage_timeout_s=HUNG_TIMEOUT_S)

    with caplog.at_level(logging.WARNING, logger="gockpt"):
        _, error, _ = run_bounded(lambda: persist(req))

    assert isinstance(error, CheckpointTimeoutError) and isinstance(error, TimeoutError)
    assert req.path in str(error) and "storage_timeout_s" in str(error)
    if hung == "write":
        assert ".safetensors" in error.filename
    fault.hook = fault.op_hook = None
    if hung == "write+rm":  # the clean-up hung too: bounded, and said so
        assert any("goes on in the background" in r.getMessage() for r in caplog.records)
    else:
        assert (store.listing(), store.listing("ckpt")) == before
    assert_loads_as(store.path("ckpt"), old, 1)


@pytest.mark.parametrize("hung", ["cat", "ls"])
def test_reading_from_a_hung_store_fails_within_the_storage_deadline(hung_store, make_request, make_tensors, hung):
    """A resume from a store that stopped answering (reads hang, or listings): finding the
    newest checkpoint and loading it raise a CheckpointTimeoutError naming the path, and
    ``is_complete`` says no, each within a bound, never a wait without end."""
    store, fault, release = hung_store
    persist(make_request(store.path("ckpt"), make_tensors(1), step=1))
    assert latest_checkpoint(store.root) == store.path("ckpt")
    fault.hang({hung}, release)
    ok, error, took = run_bounded(lambda: latest_checkpoint(store.root, timeout_s=HUNG_TIMEOUT_S))
    assert isinstance(error, CheckpointTimeoutError) and store.root.split("://")[1] in str(error), (ok, error)
    assert took < 4 * HUNG_TIMEOUT_S + 5
    complete, error, _ = run_bounded(lambda: is_complete(store.path("ckpt"), timeout_s=HUNG_TIMEOUT_S))
    assert complete is False and error is None
    if hung == "cat":  # a load lists nothing: only reads can hang it
        _, error, _ = run_bounded(lambda: read_checkpoint(store.path("ckpt"), timeout_s=HUNG_TIMEOUT_S))
        assert isinstance(error, CheckpointTimeoutError) and "manifest.json" in str(error), error
        _, error, _ = run_bounded(lambda: gockpt.load_checkpoint(store.path("ckpt"), timeout_s=HUNG_TIMEOUT_S))
        assert isinstance(error, CheckpointTimeoutError), error
    release.set()
    fault.op_hook = None
    assert read_checkpoint(store.path("ckpt")).manifest["meta"]["captured_step"] == 1


def test_asking_a_hung_store_whether_a_manifest_is_there_ends_within_the_bound(hung_store, make_request,
                                                                               make_tensors):
    """``has_manifest`` (a resume telling a damaged checkpoint from one cut short) on a store
    that stopped answering says no within its bound, as ``is_complete`` does."""
    store, fault, release = hung_store
    persist(make_request(store.path("ckpt"), make_tensors(1), step=1))
    assert has_manifest(store.path("ckpt"))
    fault.hang({"info"}, release)
    found, error, took = run_bounded(lambda: has_manifest(store.path("ckpt"), timeout_s=HUNG_TIMEOUT_S))
    assert found is False and error is None
    assert took < 2 * HUNG_TIMEOUT_S + 5


def test_a_hung_manifest_put_fails_the_save_and_keeps_what_it_may_publish(
    hung_store, make_request, make_tensors, caplog
):
    store, fault, release = hung_store
    old, new = make_tensors(1), make_tensors(2)
    persist(make_request(store.path("ckpt"), old, step=1))
    fault.hang({"pipe"}, release)
    req = make_request(store.path("ckpt"), new, step=2, storage_timeout_s=HUNG_TIMEOUT_S)

    with caplog.at_level(logging.WARNING, logger="gockpt"):
        _, error, _ = run_bounded(lambda: persist(req))

    assert isinstance(error, CheckpointTimeoutError)
    assert req.path in str(error) and "manifest.json" in error.filename
    assert any("may still land" in r.getMessage() for r in caplog.records)
    assert_loads_as(store.path("ckpt"), old, 1)
    # The abandoned put lands once the store answers: the files it names were kept, so the
    # checkpoint there is the new one, whole (never a manifest naming deleted files).
    fault.op_hook = None
    release.set()
    deadline = time.monotonic() + HUNG_BOUND_S
    while read_checkpoint(store.path("ckpt")).manifest["meta"]["captured_step"] != 2:
        assert time.monotonic() < deadline, "the abandoned put never landed"
        time.sleep(0.05)
    assert_loads_as(store.path("ckpt"), new, 2)


def test_a_hung_object_store_fails_the_engine_save_and_training_goes_on(hung_store):
    store, fault, release = hung_store
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(
        mode="lazy", storage_timeout_s=HUNG_TIMEOUT_S, slot_wait_timeout_s=2.0))

    def step():
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        engine.step_end()

    try:
        step()
        engine.save(store.path("step-1")).result(timeout_s=HUNG_BOUND_S)  # healthy: claimed
        fault.hang({"write"}, release)
        step()
        handle = engine.save(store.path("step-2"))
        step()
        _, error, _ = run_bounded(lambda: handle.result(timeout_s=HUNG_BOUND_S))
        assert isinstance(error, CheckpointTimeoutError), error
        assert store.path("step-2") in str(error)
        # Read on another thread: raised once on the training thread at the next boundary
        # (step_end, after the step's update), then training goes on.
        with pytest.raises(CheckpointTimeoutError):
            step()
        step()
        _, error, _ = run_bounded(engine.close)
        assert error is None, error
    finally:
        fault.hook = fault.op_hook = None
        release.set()
        engine.close()
    assert latest_checkpoint(store.root) == store.path("step-1")


def test_a_hung_object_store_never_holds_a_writer_claim_unbounded(hung_store):
    store, fault, release = hung_store
    # Claiming a new directory (what a first save does on the training thread) puts the owner
    # object: bounded.
    fault.hang({"pipe"}, release)
    _, error, _ = run_bounded(
        lambda: claim_directory(store.path("run"), timeout_s=HUNG_TIMEOUT_S, lease_s=3.0))
    assert isinstance(error, CheckpointTimeoutError), error
    assert store.path("run") in str(error)
    # Releasing a claim (engine.close) on a store that stopped answering: bounded too.
    fault.hook = fault.op_hook = None
    claim = claim_directory(store.path("run2"), timeout_s=HUNG_TIMEOUT_S, lease_s=3.0)
    fault.hang({"cat", "pipe", "rm"}, release)
    _, error, _ = run_bounded(claim.release)
    assert error is None


def test_moving_latest_and_removing_a_checkpoint_on_a_hung_store_are_bounded(
        hung_store, make_request, make_tensors):
    store, fault, release = hung_store
    persist(make_request(store.path("a"), make_tensors(1), step=1))
    persist(make_request(store.path("b"), make_tensors(2), step=2))
    fault.hang({"cat", "pipe", "rm"}, release)
    _, error, _ = run_bounded(lambda: gockpt.storage.advance_latest(
        store.path("b"), 2, timeout_s=HUNG_TIMEOUT_S))
    assert isinstance(error, CheckpointTimeoutError) and "latest" in str(error), error
    _, error, _ = run_bounded(lambda: gockpt.remove_checkpoint(
        store.path("a"), timeout_s=HUNG_TIMEOUT_S))
    assert isinstance(error, CheckpointTimeoutError), error
    fault.hook = fault.op_hook = None
    release.set()
    # The pointer lock was not kept by the abandoned calls: the next move goes through.
    _, error, _ = run_bounded(lambda: gockpt.storage.advance_latest(
        store.path("b"), 2, timeout_s=HUNG_TIMEOUT_S))
    assert error is None and latest_checkpoint(store.root) == store.path("b")


def test_a_pointer_write_abandoned_past_its_bound_never_lands_after_a_newer_one(
        hung_store, make_request, make_tensors):
    # Both moves of 'latest' time out while the store hangs; once it answers they land in the
    # order they were made, so the pointer ends at the newer checkpoint, never the older (or,
    # where the failed move of it to 'b' removed the pointer that named 'a', is gone: readers
    # scan and find 'b').
    store, fault, release = hung_store
    persist(make_request(store.path("a"), make_tensors(1), step=1))  # 'latest' names it
    persist(make_request(store.path("b"), make_tensors(2), step=2, update_latest=False))
    fault.hang({"pipe"}, release)
    for name, step in (("a", 1), ("b", 2)):
        _, error, _ = run_bounded(lambda: gockpt.storage.advance_latest(
            store.path(name), step, timeout_s=HUNG_TIMEOUT_S))
        assert isinstance(error, CheckpointStorageError) and "no answer" in str(error), error
    fault.hook = fault.op_hook = None
    release.set()
    # Serial calls run in order: once this one has run, both abandoned writes have landed.
    from gockpt.fsutil import bounded_call

    bounded_call(lambda: None, 10.0, "barrier", serial=True)
    fs, parent = url_to_fs(store.root, None)
    assert gockpt.storage.read_pointer(fs, parent, strict=False) in (
        None, {"name": "b", "captured_step": 2, "run": 0})
    assert latest_checkpoint(store.root) == store.path("b")


# --- a real, small filesystem ---------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(options) -> directory``: a tmpfs mounted under ``tmp_path``; skipped (with the
    reason) where mounting is not permitted."""
    mounted = []

    def mount(options: str):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_enospc_on_a_full_tmpfs_fails_the_shard_write_cleanly(small_tmpfs, make_request):
    root = small_tmpfs("size=256k")
    old = {"w": torch.arange(64.0)}
    persist(make_request(str(root / "ckpt"), old, step=1))
    before = sorted(os.listdir(root)), sorted(os.listdir(root / "ckpt"))
    big = {"big": torch.zeros(128 << 10)}  # 512 KiB: more than the filesystem holds

    with pytest.raises(CheckpointStorageError) as info:
        persist(make_request(str(root / "ckpt"), big, step=2, max_shard_bytes=1 << 20,
                             chunk_bytes=64 << 10))

    assert info.value.errno == errno.ENOSPC
    assert str(root / "ckpt") in str(info.value) and ".safetensors" in info.value.filename
    assert (sorted(os.listdir(root)), sorted(os.listdir(root / "ckpt"))) == before
    assert_loads_as(str(root / "ckpt"), old, 1)


def test_enospc_on_a_full_tmpfs_spares_a_published_checkpoint(small_tmpfs, make_request, make_tensors):
    root = small_tmpfs("size=1m")
    persist(make_request(str(root / "a"), make_tensors(1), step=1))
    new = make_tensors(2)
    req = make_request(str(root / "b"), new, step=2)
    # Measure what this save needs, then leave exactly that: the pointer finds no page.
    free = os.statvfs(root).f_bavail
    persist(dataclasses.replace(req, path=str(root / "trial"), update_latest=False))
    needed = free - os.statvfs(root).f_bavail
    subprocess.run(["rm", "-rf", str(root / "trial")], check=True)
    page = os.statvfs(root).f_frsize
    with open(root / ".filler", "wb") as f:
        f.write(b"\0" * (os.statvfs(root).f_bavail - needed) * page)
    assert os.statvfs(root).f_bavail == needed

    with pytest.warns(RuntimeWarning, match="ENOSPC") as warned:
        result = persist(req)

    assert result.published
    assert str(root / "latest") in str(warned[0].message) or str(root) in str(warned[0].message)
    assert latest_checkpoint(str(root)) == str(root / "b")
    assert_loads_as(str(root / "b"), new, 2)
    assert not [n for n in os.listdir(root) if ".gockpt-" in n]



def test_a_failed_read_of_the_newest_run_is_warned_not_taken_for_an_empty_directory(hung_store, caplog):
    # An engine's first save into a directory reads the newest run there (its 'latest'), so
    # that its checkpoints come after it. A read that failed was taken for "no pointer": a
    # silent scan of every manifest on the training thread, and a pointer of a run dated
    # ahead of this host's clock then kept 'latest' off this run with no word of it.
    from gockpt.snapshot import save_tree

    store, fault, _ = hung_store
    save_tree(store.path("ahead"), {"x": torch.ones(2)}, step=9, meta={"run": time.time_ns() + 3600 * 10**9})

    def refuse(op, path):
        if op == "cat" and path.rstrip("/").endswith("/latest"):
            raise ConnectionError("503 Slow Down")

    fault.op_hook = refuse
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="lazy", storage_timeout_s=HUNG_TIMEOUT_S))
    try:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        engine.step_end()
        with caplog.at_level(logging.WARNING, logger="gockpt"):
            handle = engine.save(store.path("mine"))
        assert any("could not read the newest run" in r.getMessage() for r in caplog.records)
        fault.op_hook = None
        handle.result(timeout_s=HUNG_BOUND_S)  # the checkpoint itself is written
    finally:
        fault.op_hook = None
        engine.close()
