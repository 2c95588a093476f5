"""errors: one hierarchy, each class also a built-in; old import paths; pickling keeps fields."""

from __future__ import annotations

import errno
import pickle

import pytest
import torch

import gockpt
from gockpt import errors


def test_every_error_is_a_checkpoint_error_and_a_builtin():
    assert issubclass(errors.CheckpointError, RuntimeError)
    assert issubclass(errors.CheckpointCorruptError, ValueError)
    assert issubclass(errors.CheckpointStorageError, OSError)
    assert issubclass(errors.CheckpointTimeoutError, TimeoutError)
    assert issubclass(errors.CheckpointTimeoutError, errors.CheckpointStorageError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.CheckpointError) and not issubclass(cls, KeyboardInterrupt)
        assert getattr(gockpt, name) is cls


def test_old_import_paths_name_the_same_classes():
    from gockpt.format import CheckpointCorruptError
    from gockpt.persist import CheckpointCancelledError
    from gockpt.transfer import CheckpointTornError

    assert CheckpointCorruptError is errors.CheckpointCorruptError
    assert CheckpointCancelledError is errors.CheckpointCancelledError
    assert CheckpointTornError is errors.CheckpointTornError


@pytest.mark.parametrize("cls", [errors.CheckpointStorageError, errors.CheckpointTimeoutError])
def test_storage_errors_pickle_with_their_fields(cls):
    e = cls("[Errno 28] No space left (writing checkpoint '/c', file '/c/x')", path="/c",
            file="/c/x", errno=errno.ENOSPC, strerror="No space left")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e)
    assert (back.path, back.filename, back.errno, back.strerror) == ("/c", "/c/x", 28, "No space left")


def test_corrupt_error_pickles_with_its_path():
    back = pickle.loads(pickle.dumps(errors.CheckpointCorruptError("bad", path="/c")))
    assert str(back) == "bad" and back.path == "/c" and isinstance(back, ValueError)


@pytest.mark.parametrize("read_handle", [False, True], ids=["unread", "read-by-its-handle"])
def test_a_failed_save_is_raised_at_a_boundary_never_inside_an_update(read_handle, caplog):
    """A save whose writes fail (EIO through a faulty fsspec filesystem), two optimizers: every
    update still applies (an error raised inside ``optimizer.step()`` would skip one while the
    other applies); the error is logged when it happens and raised once at the next
    ``step_end``, after that step's updates, unless its handle's ``result()`` raised it."""
    import logging
    import sys
    import time
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import faultfs

    root = faultfs.memory_root()
    fault = faultfs.FaultMemoryFileSystem.fault = faultfs.Fault()
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    eng = gockpt.Engine(torch.nn.ModuleList([a, b]), [oa, ob], gockpt.GoCkptConfig(mode="async"))

    def step() -> None:
        (a(torch.ones(2, 4)).sum() + b(torch.ones(2, 4)).sum()).backward()
        before = a.weight.detach().clone(), b.weight.detach().clone()
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
        assert not torch.equal(before[0], a.weight) and not torch.equal(before[1], b.weight)
        eng.step_end()

    try:
        step()
        fault.raise_after(OSError(errno.EIO, "injected EIO"), 0)
        with caplog.at_level(logging.ERROR, logger="gockpt"):
            handle = eng.save(f"{root}/ck1")
            if read_handle:
                with pytest.raises(errors.CheckpointStorageError):
                    handle.result(30)
            else:  # done() only tells it ended
                deadline = time.monotonic() + 30
                while not handle.done():
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
        assert any("ck1 failed" in r.getMessage() for r in caplog.records)
        fault.hook = None
        if read_handle:
            step()  # raised by its handle already: not again
        else:
            with pytest.raises(errors.CheckpointStorageError, match="ck1"):
                step()  # its updates applied (checked inside) before step_end raised
        step()
    finally:
        fault.hook = None
        eng.close()  # nothing left to raise


@pytest.mark.parametrize("where", ["files", "before_publish"])
def test_a_writers_own_error_is_raised_as_itself(tmp_path, where):
    # A CheckpointWriter's check before the publish fails the save with its own exception, as an
    # error in its files() does, not as a storage failure of manifest.json.
    class Refused(Exception):
        pass

    class Writer(gockpt.writer.CheckpointWriter):
        def files(self, snapshot):
            if where == "files":
                raise Refused("files")
            return {}

        def before_publish(self, snapshot):
            if where == "before_publish":
                raise Refused("before_publish")

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync"))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with pytest.raises(Refused, match=where):
        eng.save(str(tmp_path / "c"), writer=Writer())
    eng.close()
    assert not (tmp_path / "c").exists()
