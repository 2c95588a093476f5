"""Pytest plugin: run the peers' own test suites (Lightning, Accelerate) with GoCkpt injected.

What: with ``GOCKPT_INJECT=1`` in the environment,

- ``lightning.pytorch.Trainer.__init__`` is wrapped so that every Trainer whose ``plugins`` hold
  no ``CheckpointIO`` gets a fresh ``GoCkptIO()`` appended. Not injected (counted as "kept"):
  a ``CheckpointIO`` already in ``plugins`` (``TorchCheckpointIO``, ``AsyncCheckpointIO``, a
  spec'd mock, ...); a strategy *object* that carries its own ``checkpoint_io`` (Lightning raises
  if both are given); FSDP/DeepSpeed/ModelParallel strategies (covered by GoCkpt's own tests
  of them) and XLA ones, named or picked by an XLA/TPU accelerator (they take XLACheckpointIO
  only). The callback half needs nothing: the installed package adds it to every Trainer
  through the ``lightning.pytorch.callbacks_factory`` entry point (also in stock runs, inert).
- ``accelerate.Accelerator.prepare`` is wrapped so that, once it returns and the accelerator
  holds at least one prepared model and optimizer, ``GoCkptPlugin().attach(accelerator)`` runs.
  A later ``prepare`` that changes the prepared models/optimizers closes the checkpointer and
  attaches a new one. Unsupported distributed types (DeepSpeed/FSDP/Megatron/XLA) are skipped.
  ``prepare_model``/``prepare_optimizer`` alone are not wrapped. Checkpointers still attached
  when a test ends are closed in its teardown (so no engine outlives its test); an error from
  that close is listed in the terminal summary, not raised.

``GOCKPT_INJECT_SHIM=1`` (with ``GOCKPT_INJECT=1``) also lets Lightning's tests *read* GoCkpt
checkpoints as if they were files, to see what the checkpoints hold past the first assertion
that expects a file: ``torch.load`` and Lightning's ``pl_load`` (``load_from_checkpoint``) of a
directory go through ``GoCkptIO().load_checkpoint``; called from a test module,
``os.path.isfile`` is true for a checkpoint directory with a ``manifest.json``, and
``os.listdir`` / ``Path.iterdir`` / ``glob.glob`` leave out the ``latest`` pointer file. A test
that passes only with the shim failed without it for a file-vs-directory or ``latest`` reason
alone; one that still fails has a problem of its own.

Without ``GOCKPT_INJECT=1`` nothing is patched: the module only registers no-op hooks.

``GOCKPT_PEER_PRISTINE=1`` (and no ``GOCKPT_INJECT``) is the "pristine" baseline: the one patch
made is to drop the ``GoCkptCallback`` that the installed package's entry point adds to every
Trainer, so Lightning behaves as if GoCkpt were not installed. Comparing pristine with stock
shows what merely installing GoCkpt changes (e.g. a Trainer that no longer pickles).

Why: the peers' tests exercise ``ModelCheckpoint``, resuming, loops, hooks and ``save_state`` /
``load_state`` in ways our own tests do not; running them unchanged with GoCkpt swapped in shows
where GoCkpt is not a drop-in replacement.

Subprocesses: the variable is inherited. Lightning's ``strategy="ddp"`` launcher re-runs the
same ``pytest -p gockpt_inject ...`` command line, so the children inject too as long as this
directory is on ``PYTHONPATH`` (``scripts/peer_tests.sh`` puts it there). ``ddp_spawn`` children
unpickle the parent's Trainer, GoCkptIO included. A test that starts some other Python script
that builds a Trainer would not inject (none in the selected tests does).

At the end pytest prints how many Trainers / Accelerators got GoCkpt; with
``GOCKPT_INJECT_LOG=<file>`` every test id that injected at least once is appended there
(``<nodeid>\\t<lightning count>\\t<accelerate count>``), to tell failures of tests that ran
GoCkpt from ones that never did. See ``tests/peers/README.md`` for how to run it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import pytest

ENV = "GOCKPT_INJECT"
_REFUSED_STRATEGIES = ("fsdp", "deepspeed", "modelparallel", "model_parallel", "xla")

counts = {"lightning": 0, "lightning_kept": 0, "accelerate": 0, "accelerate_reattached": 0,
          "shim_load": 0, "shim_isfile": 0, "shim_latest": 0}
_test_counts = {"lightning": 0, "accelerate": 0}
_live: list[Any] = []  # GoCkptCheckpointers attached during the current test
_close_errors: list[str] = []
_installed = False


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def install() -> None:
    """Apply the patches (idempotent); does nothing unless ``GOCKPT_INJECT=1``."""
    global _installed
    if _installed:
        return
    if not enabled():
        if os.environ.get("GOCKPT_PEER_PRISTINE", "") == "1":
            _installed = True
            _drop_entry_point_callback()
        return
    _installed = True
    try:
        _patch_lightning()
        if os.environ.get("GOCKPT_INJECT_SHIM", "") == "1":
            _install_read_shims()
    except ImportError:
        pass
    try:
        _patch_accelerate()
    except ImportError:
        pass


# ---------------------------------------------------------------------------------- Lightning


def _patch_lightning() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import Strategy

    from lightning_gockpt import GoCkptIO

    original = Trainer.__init__

    def _refused(strategy: Any) -> bool:
        if isinstance(strategy, str):
            name = strategy
        elif strategy is not None:
            name = " ".join(c.__name__ for c in type(strategy).__mro__)
        else:
            return False
        return any(r in name.lower() for r in _REFUSED_STRATEGIES)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        plugins = kwargs.get("plugins")
        listed = list(plugins) if isinstance(plugins, (list, tuple)) else (
            [] if plugins is None else [plugins])
        strategy = kwargs.get("strategy")
        keep = (any(isinstance(p, CheckpointIO) for p in listed)
                or (isinstance(strategy, Strategy) and getattr(strategy, "_checkpoint_io", None) is not None)
                or _refused(strategy)
                # An XLA accelerator picks an XLA strategy, which takes XLACheckpointIO only.
                or _refused(kwargs.get("accelerator")) or kwargs.get("accelerator") == "tpu")
        if keep:
            counts["lightning_kept"] += 1
        else:
            kwargs["plugins"] = [*listed, GoCkptIO()]
            counts["lightning"] += 1
            _test_counts["lightning"] += 1
        original(self, *args, **kwargs)

    Trainer.__init__ = __init__  # type: ignore[method-assign]


def _drop_entry_point_callback() -> None:
    # Lightning's registry looks entry points up through its module-global ``entry_points``.
    from lightning.fabric.utilities import registry

    original = registry.entry_points

    @functools.wraps(original)
    def entry_points(**params: Any) -> Any:
        found = original(**params)
        if params.get("group") != "lightning.pytorch.callbacks_factory":
            return found
        return [ep for ep in found if not ep.value.startswith("lightning_gockpt")]

    registry.entry_points = entry_points


def _from_test(depth: int = 2) -> bool:
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.startswith(("tests_pytorch", "tests."))


def _install_read_shims() -> None:
    import glob
    import pathlib

    import torch
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    from lightning_gockpt import GoCkptIO

    def is_ckpt_dir(p: Any) -> bool:
        return isinstance(p, (str, os.PathLike)) and os.path.isdir(p)

    def read(p: Any, map_location: Any, weights_only: Any) -> Any:
        counts["shim_load"] += 1
        return GoCkptIO().load_checkpoint(p, map_location=map_location, weights_only=weights_only)

    torch_load = torch.load

    @functools.wraps(torch_load)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if is_ckpt_dir(f):
            return read(f, map_location, kwargs.get("weights_only"))
        return torch_load(f, map_location, *args, **kwargs)

    torch.load = load

    pl_load = cloud_io._load

    @functools.wraps(pl_load)
    def _load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if is_ckpt_dir(path_or_url):
            return read(path_or_url, map_location, weights_only)
        return pl_load(path_or_url, map_location, weights_only)

    cloud_io._load = _load
    saving.pl_load = _load

    isfile = os.path.isfile

    def _isfile(p: Any) -> bool:
        if isfile(p):
            return True
        if _from_test() and is_ckpt_dir(p) and isfile(os.path.join(p, "manifest.json")):
            counts["shim_isfile"] += 1
            return True
        return False

    os.path.isfile = _isfile

    def pointer(p: Any) -> bool:
        if os.path.basename(os.fspath(p)) == "latest" and isfile(p):
            counts["shim_latest"] += 1
            return True
        return False

    listdir = os.listdir

    def _listdir(p: Any = ".") -> list:
        names = listdir(p)
        if _from_test():
            names = [n for n in names if not (isinstance(n, str) and pointer(os.path.join(p, n)))]
        return names

    os.listdir = _listdir

    iterdir = pathlib.Path.iterdir

    def _iterdir(self: pathlib.Path):  # type: ignore[no-untyped-def]
        entries = list(iterdir(self))
        if _from_test():
            entries = [e for e in entries if not pointer(e)]
        return iter(entries)

    pathlib.Path.iterdir = _iterdir  # type: ignore[method-assign]

    glob_glob = glob.glob

    @functools.wraps(glob_glob)
    def _glob(*args: Any, **kwargs: Any) -> list:
        found = glob_glob(*args, **kwargs)
        if _from_test():
            found = [f for f in found if not pointer(f)]
        return found

    glob.glob = _glob


# ---------------------------------------------------------------------------------- Accelerate


def _patch_accelerate() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from accelerate_gockpt import GoCkptPlugin
    from accelerate_gockpt.checkpointer import GoCkptCheckpointer

    original = Accelerator.prepare
    unsupported = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                   DistributedType.XLA)

    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not self._models or not self._optimizers or self.distributed_type in unsupported:
            return result
        current = getattr(self.save_state, "__self__", None)
        if isinstance(current, GoCkptCheckpointer):
            same = ([id(m) for m in current._models] == [id(self.unwrap_model(m)) for m in self._models]
                    and [id(o) for o in current._optimizers] == [id(o.optimizer) for o in self._optimizers])
            if same:
                return result
            current.close()
            counts["accelerate_reattached"] += 1
        checkpointer = GoCkptPlugin().attach(self)
        if checkpointer is not None:
            _live.append(checkpointer)
            counts["accelerate"] += 1
            _test_counts["accelerate"] += 1
        return result

    Accelerator.prepare = prepare  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------- pytest hooks


def pytest_configure(config: pytest.Config) -> None:
    install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    _test_counts.update(lightning=0, accelerate=0)
    yield
    path = os.environ.get("GOCKPT_INJECT_LOG")
    if enabled() and path and (_test_counts["lightning"] or _test_counts["accelerate"]):
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{item.nodeid}\t{_test_counts['lightning']}\t{_test_counts['accelerate']}\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    # Before the test's fixtures are finalized. A failure here is usually a save still in flight
    # when the test removed its temporary directory (stock save_state is synchronous), so it is
    # listed in the summary instead of failing the test.
    live, _live[:] = list(_live), []
    for checkpointer in live:
        try:
            checkpointer.close()
        except Exception as e:  # noqa: BLE001
            _close_errors.append(f"{item.nodeid}: {type(e).__name__}: {e}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if enabled():
        terminalreporter.write_line(
            "gockpt_inject: GoCkptIO added to {lightning} Trainers ({lightning_kept} kept their own "
            "CheckpointIO or a refused strategy); GoCkpt attached to {accelerate} Accelerators "
            "({accelerate_reattached} re-attachments)".format(**counts))
        if os.environ.get("GOCKPT_INJECT_SHIM", "") == "1":
            terminalreporter.write_line(
                "gockpt_inject shim: {shim_load} checkpoint directories read as files, "
                "{shim_isfile} isfile() answered for a directory, {shim_latest} `latest` entries "
                "hidden".format(**counts))
        for line in _close_errors:
            terminalreporter.write_line(f"gockpt_inject: close at teardown failed: {line}")
