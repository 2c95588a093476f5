"""The framework seam of ``gockpt.convert``: adapters provide their formats, the engine imports none.

- the engine package imports no adapter and no import cycle is left (``scripts/check_imports.py``);
- ``pyproject.toml`` declares Lightning's :class:`~gockpt.convert.Framework` as the entry point
  ``lightning`` of ``gockpt.frameworks``, and the name resolves (the installed metadata too);
- a framework registered in code drives ``open_source``, ``to_gockpt`` and ``gockpt convert
  --to lightning`` (no Lightning needed);
- entry points are imported on first use, once; one that does not import, or is missing, fails
  the conversion that needs it, naming what to install, and nothing else.

Entry points come from real distribution metadata written under ``tmp_path`` (a private group),
never from a patched ``importlib.metadata``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gockpt import cli, convert, frameworks
from gockpt.convert import (
    FRAMEWORKS_GROUP,
    LIGHTNING,
    Framework,
    FrameworkUnavailableError,
    get_framework,
    open_source,
    register_framework,
    to_gockpt,
)
from gockpt.snapshot import save_tree

REPO = Path(__file__).resolve().parents[1]
LIGHTNING_ENTRY = "lightning_gockpt.convert:FRAMEWORK"
TEST_GROUP = "gockpt.frameworks.test"
FAKE_MODULE = "_gockpt_test_framework"
BROKEN_MODULE = "_gockpt_test_broken_framework"


class FakeLightning:
    """A Lightning framework in code: records its calls, reads and writes plain dicts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.loaded = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 7,
                       "pytorch-lightning_version": "2.4.0"}

    def load_gockpt(self, *args, **kwargs):
        self.calls.append(("load_gockpt", args, kwargs))
        return self.loaded

    def save_gockpt(self, *args, **kwargs):
        self.calls.append(("save_gockpt", args, kwargs))

    def to_file(self, source, dst, **kwargs):
        self.calls.append(("to_file", (source, dst), kwargs))
        torch.save(source.lightning, dst)
        return Path(dst).stat().st_size

    def framework(self) -> Framework:
        return Framework(LIGHTNING, load_gockpt=self.load_gockpt, save_gockpt=self.save_gockpt,
                         to_file=self.to_file)


@pytest.fixture
def registry(monkeypatch):
    """An empty registry over a private entry point group, restored afterwards."""
    monkeypatch.setattr(frameworks, "_frameworks", {})
    monkeypatch.setattr(frameworks, "FRAMEWORKS_GROUP", TEST_GROUP)


@pytest.fixture
def installed(tmp_path, monkeypatch, registry):
    """A distribution on sys.path whose entry points in the private group are ``fake`` (a
    module of its own), ``wrong`` (not a Framework), ``lightning`` (Lightning missing on import)."""
    site = tmp_path / "site"
    info = site / "gockpt_test_frameworks-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gockpt-test-frameworks\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(
        f"[{TEST_GROUP}]\nfake = {FAKE_MODULE}:FRAMEWORK\nwrong = {FAKE_MODULE}:NOT_ONE\n"
        f"lightning = {BROKEN_MODULE}:FRAMEWORK\n")
    (site / f"{FAKE_MODULE}.py").write_text(
        "from gockpt.convert import Framework\n"
        "FRAMEWORK = Framework('fake', load_gockpt=dict, save_gockpt=print, to_file=len)\n"
        "NOT_ONE = object()\n")
    # What lightning_gockpt.convert raises on import where Lightning is not installed.
    (site / f"{BROKEN_MODULE}.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lightning'\", name='lightning')\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in (FAKE_MODULE, BROKEN_MODULE):
        sys.modules.pop(name, None)


def _lightning_checkpoint(path: Path) -> str:
    """A GoCkpt checkpoint as GoCkptIO lays it out: Lightning's dict under extra["lightning"]."""
    save_tree(str(path), {LIGHTNING: {"state_dict": {"w": torch.arange(4.0)},
                                      "global_step": 7}}, step=7)
    return str(path)


# --- layering ------------------------------------------------------------------------------


def test_engine_imports_no_adapter_and_no_import_cycle_remains():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "check_imports.py")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_the_checker_sees_local_and_dynamic_adapter_imports(tmp_path):
    script = REPO / "scripts" / "check_imports.py"
    spec = importlib.util.spec_from_file_location("check_imports", script)
    check_imports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_imports)
    for package in check_imports.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "gockpt" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lightning_gockpt\n"
        "def f():\n    from lightning_gockpt.b import g\n"
        "def h():\n    import importlib\n    importlib.import_module('accelerate_gockpt')\n")
    (tmp_path / "lightning_gockpt" / "b.py").write_text("from gockpt import a\ndef g(): pass\n")
    problems = check_imports.check(tmp_path)
    assert [p.split(": ")[0] for p in problems[:2]] == ["gockpt/a.py:5", "gockpt/a.py:8"]
    assert "package import cycle: gockpt <-> lightning_gockpt" in problems
    assert "module import cycle: gockpt.a <-> lightning_gockpt.b" in problems
    assert len(problems) == 4


# --- the Lightning entry point -------------------------------------------------------------


def test_pyproject_declares_the_lightning_framework_and_it_resolves():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["entry-points"][FRAMEWORKS_GROUP] == {LIGHTNING: LIGHTNING_ENTRY}
    pytest.importorskip("lightning")
    module, _, attr = LIGHTNING_ENTRY.partition(":")
    lightning_convert = importlib.import_module(module)
    framework = getattr(lightning_convert, attr)
    assert isinstance(framework, Framework) and framework.name == LIGHTNING
    assert framework.load_gockpt is lightning_convert.load_gockpt_lightning
    assert framework.save_gockpt is lightning_convert.save_gockpt_lightning
    assert framework.to_file is lightning_convert.to_lightning_file


def test_installed_metadata_registers_the_lightning_framework(monkeypatch):
    """Needs gockpt installed from this tree (``pip install -e .``) since the entry point was added."""
    pytest.importorskip("lightning")
    monkeypatch.setattr(frameworks, "_frameworks", {})
    entries = importlib.metadata.entry_points(group=FRAMEWORKS_GROUP, name=LIGHTNING)
    assert [e.value for e in entries] == [LIGHTNING_ENTRY], \
        "stale metadata: reinstall gockpt (pip install -e . --no-deps --no-build-isolation)"
    from lightning_gockpt.convert import FRAMEWORK

    assert get_framework(LIGHTNING) is FRAMEWORK


# --- frameworks registered in code ---------------------------------------------------------


def test_a_registered_framework_reads_writes_and_exports_lightning(tmp_path, registry, capsys):
    fake = FakeLightning()
    register_framework(fake.framework())

    path = _lightning_checkpoint(tmp_path / "ours")
    source = open_source(path)
    assert (source.kind, source.step, source.lightning) == ("gockpt-lightning", 7, fake.loaded)
    assert list(source.model_state_dict) == ["w"]
    assert fake.calls[-1] == ("load_gockpt", (path,),
                              {"storage_options": {}, "allow_pickle": False, "verify": False})

    stock = tmp_path / "stock.ckpt"
    torch.save(fake.loaded, stock)
    to_gockpt(open_source(str(stock)), str(tmp_path / "converted"), max_shard_bytes=123)
    name, args, kwargs = fake.calls[-1]
    assert (name, args[1], kwargs) == ("save_gockpt", str(tmp_path / "converted"),
                                       {"storage_options": None, "max_shard_bytes": 123})
    assert args[0]["global_step"] == 7

    out = tmp_path / "model.ckpt"
    assert cli.main(["convert", path, str(out), "--to", "lightning"]) == 0
    assert "one Lightning .ckpt file" in capsys.readouterr().out
    assert fake.calls[-1][0] == "to_file"
    assert torch.load(out)["global_step"] == 7


def test_register_framework_takes_only_a_framework(registry):
    with pytest.raises(TypeError, match="not FakeLightning"):
        register_framework(FakeLightning())  # type: ignore[arg-type]


def test_checkpoints_of_no_framework_never_consult_the_registry(tmp_path, registry):
    path = str(tmp_path / "engine")
    save_tree(path, {"user": 1}, model={"w": torch.ones(2)}, step=3)
    source = open_source(path)  # the private group is empty: a lookup would raise
    assert (source.kind, source.step, source.lightning) == ("gockpt", 3, None)


# --- entry points --------------------------------------------------------------------------


def test_an_entry_point_is_imported_on_first_use_and_once(installed):
    assert FAKE_MODULE not in sys.modules
    first = get_framework("fake")
    assert first.name == "fake" and FAKE_MODULE in sys.modules
    del sys.modules[FAKE_MODULE]
    assert get_framework("fake") is first  # not imported again
    assert FAKE_MODULE not in sys.modules
    with pytest.raises(TypeError, match="is not a gockpt.convert.Framework named 'wrong'"):
        get_framework("wrong")


def test_registered_in_code_comes_before_the_entry_point(installed):
    fake = FakeLightning().framework()
    register_framework(fake)
    assert get_framework(LIGHTNING) is fake


def test_a_framework_that_does_not_import_fails_only_the_conversion_needing_it(tmp_path, installed,
                                                                                capsys):
    path = _lightning_checkpoint(tmp_path / "ours")
    with pytest.raises(FrameworkUnavailableError) as e:
        open_source(path)
    assert str(e.value).startswith(f"{path}: a Lightning checkpoint: install lightning to convert it")
    assert isinstance(e.value, ModuleNotFoundError) and e.value.name == "lightning"
    assert isinstance(e.value.__cause__, ModuleNotFoundError)

    assert cli.main(["convert", path, str(tmp_path / "x.ckpt"), "--to", "lightning"]) == 1
    err = capsys.readouterr().err
    assert "a Lightning checkpoint: install lightning to convert it" in err
    assert "pip install 'gockpt[lightning]'" in err

    stock = tmp_path / "stock.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "pytorch-lightning_version": "2.4.0"}, stock)
    source = open_source(str(stock))  # reading a .ckpt needs no framework; writing GoCkpt does
    assert source.lightning is not None
    with pytest.raises(FrameworkUnavailableError, match="a Lightning checkpoint: install lightning"):
        to_gockpt(source, str(tmp_path / "converted"))
    # --to lightning needs the framework even for a source it would then refuse.
    assert cli.main(["convert", str(stock), str(tmp_path / "y.ckpt"), "--to", "lightning"]) == 1
    assert "--to lightning: install lightning to convert it" in capsys.readouterr().err


def test_a_framework_registered_nowhere_is_named(installed):
    with pytest.raises(FrameworkUnavailableError) as e:
        get_framework("nothing", needed_for="x: a Nothing checkpoint")
    assert str(e.value).startswith("x: a Nothing checkpoint: install nothing to convert it (no "
                                   f"'nothing' framework in the entry point group '{TEST_GROUP}'")
    assert e.value.name == "nothing"


def test_convert_re_exports_the_registry():
    assert convert.Framework is frameworks.Framework
    assert convert.get_framework is frameworks.get_framework
    assert convert.register_framework is frameworks.register_framework
    assert convert.FrameworkUnavailableError is frameworks.FrameworkUnavailableError
