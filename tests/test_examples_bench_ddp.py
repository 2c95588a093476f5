"""examples/bench_ddp_shares.py and its emulated storage link (examples/throttled_fs.py).

Behaviour only: the throttled filesystem carries every byte a save writes through one link per
process, and the benchmark's emulated rows run and say what they emulate. No wall time is
checked.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gockpt
from gockpt import fsutil

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_spec = importlib.util.spec_from_file_location("throttled_fs", _EXAMPLES / "throttled_fs.py")
assert _spec is not None and _spec.loader is not None
throttled_fs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = throttled_fs
_spec.loader.exec_module(throttled_fs)  # registers the "throttled" protocol with fsspec


def test_throttled_fs_carries_every_written_byte_through_the_process_link(tmp_path):
    """A plain local path resolves to the throttled filesystem through ``storage_options`` (the
    way GoCkpt's derived part paths do), it counts as local, and an engine's save sends exactly
    the bytes it wrote through this process's link; the checkpoint loads as saved."""
    options = throttled_fs.storage_options(1 << 40, link="test-engine")  # fast: no wait to speak of
    fs, _ = fsutil.url_to_fs(str(tmp_path), options)
    assert isinstance(fs, throttled_fs.ThrottledFileSystem) and fsutil.is_local(fs)
    link = throttled_fs.get_link("test-engine", 1 << 40)
    assert fs.link is link
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync", storage_options=options))
    try:
        metrics = engine.save(str(tmp_path / "ck")).result()
    finally:
        engine.close()
    assert metrics.persist_bytes > 0
    # The latest pointer is written through it too, after the checkpoint.
    assert link.bytes_sent >= metrics.persist_bytes
    state = gockpt.load_checkpoint(str(tmp_path / "ck"))
    assert all(torch.equal(state.model_state_dict[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="write_bytes_per_s"):
        throttled_fs.ThrottledFileSystem(0)


def test_bench_ddp_shares_prints_the_emulated_rows(tmp_path):
    """The benchmark at a tiny size with ``--link-mib-s``: the local-disk rows and the EMULATED
    rows of both setups, their ratios, the emulated bandwidth, and both ranks' links carrying
    bytes when they share the write (rank 0's alone with one writer)."""
    out = subprocess.run(
        [sys.executable, str(_EXAMPLES / "bench_ddp_shares.py"), "--state-mib", "8", "--checkpoints", "1",
         "--link-mib-s", "512", "--dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split() for line in out.splitlines() if _is_row(line)]
    labels = [" ".join(r[:3]) for r in rows]
    assert labels == ["1 writer local", "2 sharing writers", "1 writer EMULATED", "2 sharing writers"], out
    emulated = [line for line in out.splitlines() if "EMULATED 512 MiB/s link per process" in line]
    assert len(emulated) == 3, out  # two rows and their ratio
    assert "persist time ratio (sharing / 1 writer), local disk:" in out
    assert "paced to 512 MiB/s" in out
    through = out.rpartition("Bytes through each rank's link per checkpoint:")[2]
    one, _, sharing = through.partition("sharing")
    assert "'0.0 MiB'" in one and "'0.0 MiB'" not in sharing, out
    assert list(tmp_path.iterdir()) == []  # the run removes its checkpoints


def _is_row(line: str) -> bool:
    """A table row: a setup, its storage, then two numbers (persist_s, request->durable_s)."""
    try:
        [float(x) for x in line.split()[-2:]]
    except ValueError:
        return False
    return "writer" in line
