"""errors: one hierarchy, each class also a built-in; old import paths; pickling keeps fields."""

from __future__ import annotations

import errno
import pickle

import pytest

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
