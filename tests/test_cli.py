"""The ``gockpt`` command line, run as a subprocess on the checkpoints of real Lightning runs.

A 12-step run of the adapter tests' TinyNet with ``GoCkptIO`` (mode ``gockpt``, K = 2) and the
same run without GoCkpt (stock ``.ckpt`` files, and the reference end state) give the
checkpoints; an Accelerate ``save_state`` folder gives a third kind. ``python -m gockpt
inspect`` runs as a subprocess, the other commands in-process, then each test checks one result:
round trips are bit for bit, and the stock checkpoint converted to GoCkpt resumes exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "adapters"))  # the adapter tests' job

from _lightning_train import TinyNet, assert_bitwise_equal, fit, results  # noqa: E402

import gockpt  # noqa: E402
from gockpt import cli  # noqa: E402
from lightning_gockpt import GoCkptIO  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 4


def _gockpt_io() -> GoCkptIO:
    return GoCkptIO(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints of the three kinds, the reference end state, and every CLI result."""
    root = tmp_path_factory.mktemp("cli")
    fit(str(root / "gockpt"), io=_gockpt_io(), max_steps=STEPS, ckpt_every=EVERY)
    reference = results(*fit(str(root / "stock"), max_steps=STEPS, ckpt_every=EVERY))
    ours, stock = root / "gockpt" / "step=8.ckpt", root / "stock" / "step=8.ckpt"
    flipped = root / "flipped.ckpt"
    shutil.copytree(ours, flipped)
    shard = next(flipped.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # a bit of the last tensor's data: only the checksum can tell
    shard.write_bytes(bytes(data))
    accelerate_dir, accelerate_state = _accelerate_folder(root / "accelerate")
    (root / "incomplete.ckpt").mkdir()  # a save cut short: no manifest
    out = root / "out"
    # One command runs as a subprocess (the entry point, ``python -m gockpt``); the others run
    # in-process (cli.main) meanwhile: every start costs seconds of imports on a 2-core machine.
    procs = {"inspect": _start(["-m", "gockpt", "inspect", str(ours)])}
    commands = {
        "verify_flipped": ["verify", str(flipped)],
        "lightning": ["convert", str(ours), str(out / "model.ckpt"), "--to", "lightning"],
        "dcp": ["convert", str(ours), str(out / "dcp"), "--to", "dcp"],
        "hf_sharded": ["convert", str(ours), str(out / "hf_sharded"), "--to", "hf", "--prefix",
                       "net.", "--max-shard-size", "2KB"],
        "from_stock": ["convert", str(stock), str(out / "converted.ckpt"), "--to", "gockpt"],
        "from_accelerate": ["convert", str(accelerate_dir), str(out / "from_accelerate"),
                            "--to", "gockpt"],
    }
    done = {"from_stock": _run_in_process(commands.pop("from_stock"))}
    # The resumed run goes in a process of its own: a crash there must fail this test only.
    config = root / "resume.json"
    config.write_text(json.dumps([{
        "root": str(root / "resumed"), "io": {"mode": "gockpt", "min_overlap_steps": 2,
                                              "max_overlap_steps": 2},
        "max_steps": STEPS, "ckpt_path": str(out / "converted.ckpt"),
        "results_path": str(root / "resumed.pt")}]))
    procs["resume"] = _start([str(REPO / "tests" / "adapters" / "_lightning_train.py"), str(config)])
    done.update({name: _run_in_process(argv) for name, argv in commands.items()})
    done.update({name: _finish(proc) for name, proc in procs.items()})
    return {"root": root, "ours": ours, "stock": stock, "flipped_shard": shard, "out": out,
            "reference": reference, "accelerate_state": accelerate_state, "cli": done}


def _start(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _run_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return subprocess.CompletedProcess(["gockpt", *argv], code, out.getvalue(), err.getvalue())


def _ok(runs, name: str) -> subprocess.CompletedProcess:
    res = runs["cli"][name]
    assert res.returncode == 0, f"gockpt {name} failed:\n{res.stdout}\n{res.stderr}"
    return res


def _accelerate_folder(path: Path):
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = accelerate.Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    for _ in range(3):
        acc.backward(model(torch.randn(5, 4)).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    acc.save_state(str(path))
    state = {"model": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
             "optimizer": opt.optimizer.state_dict(), "scheduler": sched.scheduler.state_dict()}
    return path, state


def _in_process(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_steps_mode_k_sizes_backend_and_completeness(runs, capsys):
    text = _ok(runs, "inspect").stdout
    for field in ("requested_step  8", "captured_step   9", "mode            gockpt (K=2)",
                  "complete        yes", "replay", "files", "tensors"):
        assert field in text, text
    code, out, _ = _in_process(capsys, "inspect", str(runs["ours"]), "--json", "--tensors")
    info = json.loads(out)
    manifest = json.loads((runs["ours"] / "manifest.json").read_text())
    assert (info["requested_step"], info["captured_step"], info["num_overlap_steps"]) == (8, 9, 2)
    assert info["replay"]["backend"] == manifest["meta"]["replay"]["backend"]
    assert info["replay"]["backend"] in text
    assert set(info["tensors"]) == set(manifest["tensors"])
    assert info["files"] == {n: f["bytes"] for n, f in manifest["files"].items()}
    code, _, err = _in_process(capsys, "inspect", str(runs["root"] / "incomplete.ckpt"))
    assert code == 1 and "not a complete checkpoint" in err


def test_verify_passes_and_a_flipped_byte_fails_naming_the_file(runs, capsys):
    code, out, _ = _in_process(capsys, "verify", str(runs["ours"]))
    assert code == 0 and out.startswith("OK ")
    res = runs["cli"]["verify_flipped"]
    assert res.returncode == 1
    assert f"FAILED {runs['flipped_shard']}: xxh3-64 checksum" in res.stdout


def test_verify_refuses_a_shard_linked_out_of_the_checkpoint(runs, capsys, tmp_path):
    # A shard replaced by a symlink to an identical copy elsewhere: sizes and checksums match,
    # yet a checkpoint must not read files outside itself.
    linked = tmp_path / "linked.ckpt"
    shutil.copytree(runs["ours"], linked)
    shard = next(linked.glob("*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    code, out, _ = _in_process(capsys, "verify", str(linked))
    assert code == 1 and f"FAILED {shard}" in out and "symbolic link" in out


def test_to_lightning_loads_with_stock_load_from_checkpoint(runs):
    _ok(runs, "lightning")
    path = runs["out"] / "model.ckpt"
    want = GoCkptIO().load_checkpoint(runs["ours"])  # what a Trainer with the plugin resumes from
    got = torch.load(path, weights_only=False)
    assert_bitwise_equal(got, want, "torch.load")
    model = TinyNet.load_from_checkpoint(path)  # stock Lightning, no GoCkpt involved
    assert_bitwise_equal(model.state_dict(), want["state_dict"], "load_from_checkpoint")
    assert model.hparams.lr == want["hyper_parameters"]["lr"]


def test_to_dcp_loads_with_dcp_load(runs):
    import torch.distributed.checkpoint as dcp

    _ok(runs, "dcp")
    want = GoCkptIO().load_checkpoint(runs["ours"])
    template = {"state_dict": {k: torch.zeros_like(v) for k, v in want["state_dict"].items()},
                "optimizer_states": [{"state": {i: {n: torch.zeros_like(t) for n, t in st.items()}
                                                for i, st in want["optimizer_states"][0]["state"].items()}}]}
    dcp.load(template, checkpoint_id=str(runs["out"] / "dcp"), no_dist=True)
    assert_bitwise_equal(template["state_dict"], want["state_dict"], "state_dict")
    assert_bitwise_equal(template["optimizer_states"][0]["state"],
                         want["optimizer_states"][0]["state"], "optimizer state")


def test_to_hf_strips_the_prefix_and_shards_with_an_index(runs, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    code, _, err = _in_process(capsys, "convert", str(runs["ours"]), str(runs["out"] / "hf"),
                               "--to", "hf", "--prefix", "net.")
    assert code == 0, err
    want = {k[len("net."):]: v for k, v in GoCkptIO().load_checkpoint(runs["ours"])["state_dict"].items()}
    single = runs["out"] / "hf" / "model.safetensors"
    assert_bitwise_equal(load_file(single), want, "model.safetensors")
    with safe_open(single, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    _ok(runs, "hf_sharded")
    index = json.loads((runs["out"] / "hf_sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and set(index["weight_map"]) == set(want)
    merged = {}
    for name in files:
        merged.update(load_file(runs["out"] / "hf_sharded" / name))
    assert_bitwise_equal(merged, want, "sharded")


def _run_of(path) -> int:
    """The ``run`` a checkpoint's manifest records (orders it for ``latest``)."""
    return gockpt.storage.read_manifest(*gockpt.storage.url_to_fs(str(path), None))["meta"]["run"]


def test_stock_ckpt_converted_to_gockpt_resumes_exactly(runs):
    _ok(runs, "from_stock")
    converted = runs["out"] / "converted.ckpt"
    stock = torch.load(runs["stock"], weights_only=False)
    assert_bitwise_equal(GoCkptIO().load_checkpoint(converted), stock, "converted")
    assert _run_of(converted) == 0  # its run is unknown: before any engine's checkpoints
    res = runs["cli"]["resume"]  # fit(ckpt_path=converted) with GoCkptIO, in a subprocess
    assert res.returncode == 0, f"the resumed run failed ({res.returncode}):\n{res.stderr[-3000:]}"
    resumed = torch.load(runs["root"] / "resumed.pt", weights_only=False)
    ref = runs["reference"]
    assert sorted(resumed["losses"]) == list(range(8, STEPS))
    for batch, loss in resumed["losses"].items():
        assert loss == ref["losses"][batch], f"loss of batch {batch}"
    assert_bitwise_equal(resumed["model"], ref["model"], "model")
    assert_bitwise_equal(resumed["optim"], ref["optim"], "optimizer")


def test_accelerate_folder_converted_to_gockpt_loads_as_engine_state(runs):
    _ok(runs, "from_accelerate")
    state = gockpt.load_checkpoint(str(runs["out"] / "from_accelerate"))
    want = runs["accelerate_state"]
    assert_bitwise_equal(state.model_state_dict, want["model"], "model")
    assert_bitwise_equal(state.optimizer_state_dicts[0], want["optimizer"], "optimizer")
    assert state.extra["accelerate"]["scheduler"] == want["scheduler"]
    assert_bitwise_equal(state.extra["accelerate"]["scheduler"], want["scheduler"], "scheduler")
    assert state.captured_step == 3
    assert _run_of(runs["out"] / "from_accelerate") == 0
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = gockpt.Engine(model, opt)
    try:
        extra = engine.restore(str(runs["out"] / "from_accelerate"))
        assert engine.version == 3
    finally:
        engine.close()
    assert_bitwise_equal(model.state_dict(), want["model"], "restored model")
    assert_bitwise_equal(opt.state_dict(), want["optimizer"], "restored optimizer")
    assert_bitwise_equal(extra["accelerate"]["scheduler"], want["scheduler"], "restored extra")


def test_fsspec_urls_in_and_out(runs):
    # In-process: memory:// is private to this process.
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"memory://cli-{os.getpid()}"
    fs.put(str(runs["stock"]), f"{root}/stock.ckpt")
    assert cli.main(["convert", f"{root}/stock.ckpt", f"{root}/run/g.ckpt", "--to", "gockpt"]) == 0
    assert cli.main(["verify", f"{root}/run/g.ckpt"]) == 0
    assert cli.main(["convert", f"{root}/run/g.ckpt", f"{root}/back/l.ckpt", "--to", "lightning"]) == 0
    with fsspec.open(f"{root}/back/l.ckpt", "rb") as f:
        back = torch.load(f, weights_only=False)
    assert_bitwise_equal(back, torch.load(runs["stock"], weights_only=False), "round trip")


def test_usage_errors_and_wrong_sources(runs, capsys):
    assert cli.main(["convert", str(runs["ours"]), str(runs["root"] / "x"), "--to", "gockpt"]) == 1
    assert "already a GoCkpt checkpoint" in capsys.readouterr().err
    assert cli.main(["convert", str(runs["stock"]), str(runs["root"] / "y.ckpt"), "--to",
                     "lightning"]) == 1
    assert "not a GoCkpt checkpoint written by GoCkptIO" in capsys.readouterr().err
    assert cli.main(["convert", str(runs["ours"]), str(runs["root"] / "z"), "--to", "hf",
                     "--prefix", "nope."]) == 1
    assert "no model key starts with 'nope.'" in capsys.readouterr().err
    for argv in (["convert", "a", "b", "--to", "onnx"],
                 ["convert", "a", "b", "--to", "hf", "--max-shard-size", "lots"],
                 ["convert", str(runs["ours"]), "b", "--to", "lightning", "--prefix", "net."],
                 ["inspect", str(runs["ours"]), "--storage-options", "{not json"],
                 ["inspect", str(runs["ours"]), "--storage-options", "[1]"]):
        with pytest.raises(SystemExit) as e:  # a usage error: exit 2, before any file is read
            cli.main(argv)
        assert e.value.code == 2, argv
    assert "--max-shard-size" in capsys.readouterr().err
    assert cli.main(["inspect", str(runs["ours"]), "--storage-options", ""]) == 0  # none given


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_a_damaged_torch_save_source_is_an_error_naming_the_file(tmp_path, capsys, damage):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64)}, "global_step": 1}, path)
    data = path.read_bytes()
    path.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    for to in ("gockpt", "hf"):
        code, _, err = _in_process(capsys, "convert", str(path), str(tmp_path / to), "--to", to)
        assert code == 1 and f"{path}: not a readable torch.save file" in err, err
        assert "Traceback" not in err and not (tmp_path / to).exists()


def test_to_hf_writes_tied_weights_under_each_name(tmp_path, capsys):
    from safetensors.torch import load_file

    tied = torch.randn(4, 3)
    state = {"embed.weight": tied, "head.weight": tied, "head.bias": torch.randn(4)}
    torch.save(state, tmp_path / "tied.pt")
    code, _, err = _in_process(capsys, "convert", str(tmp_path / "tied.pt"), str(tmp_path / "hf"),
                               "--to", "hf")
    assert code == 0, err
    assert_bitwise_equal(load_file(tmp_path / "hf" / "model.safetensors"), state, "model.safetensors")


def test_to_lightning_keeps_the_strides_gockptio_loads(tmp_path, capsys):
    """A buffer stored transposed: the ``.ckpt`` written holds the dict ``GoCkptIO`` loads, with
    its strides, as the stock file held it."""
    buf = torch.randn(5, 8).t()
    stock = {"state_dict": {"buf": buf, "w": torch.randn(3)}, "global_step": 3,
             "pytorch-lightning_version": "2.6.0"}
    torch.save(stock, tmp_path / "stock.ckpt")
    for argv in (["convert", str(tmp_path / "stock.ckpt"), str(tmp_path / "g.ckpt"), "--to", "gockpt"],
                 ["convert", str(tmp_path / "g.ckpt"), str(tmp_path / "back.ckpt"), "--to", "lightning"]):
        code, _, err = _in_process(capsys, *argv)
        assert code == 0, err
    loaded = GoCkptIO().load_checkpoint(str(tmp_path / "g.ckpt"))["state_dict"]["buf"]
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)["state_dict"]["buf"]
    assert loaded.stride() == buf.stride() == back.stride()
    assert torch.equal(back, buf)


def _within(fn, timeout_s: float = 20.0):
    """``fn()``'s result or exception, failing the test if it has not returned in ``timeout_s``."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the caller
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "hung on a hostile manifest.json"
    return out


@pytest.mark.parametrize("kind", ["oversized", "fifo", "dev_zero"])
def test_inspect_and_verify_refuse_a_hostile_manifest_without_reading_it(tmp_path, capsys, kind):
    from gockpt.audit import read_manifest
    from gockpt.snapshot import save_tree

    path = tmp_path / "ckpt"
    save_tree(str(path), None, model={"w": torch.ones(3)}, update_latest=False)
    manifest = path / "manifest.json"
    manifest.unlink()
    if kind == "oversized":
        # Sparse, 64 GiB: reading it whole would exhaust memory; the size is refused first.
        with open(manifest, "wb") as f:
            f.truncate(1 << 36)
        fragment = "larger than"
    elif kind == "fifo":
        os.mkfifo(manifest)  # no writer: an open without O_NONBLOCK would block forever
        fragment = "FIFO"
    else:
        manifest.symlink_to("/dev/zero")  # endless
        fragment = "symbolic link"
    error = _within(lambda: read_manifest(str(path))).get("error")
    assert isinstance(error, gockpt.CheckpointCorruptError), repr(error)
    assert "manifest.json" in str(error) and fragment in str(error), str(error)
    for command in ("inspect", "verify"):
        capsys.readouterr()
        assert _within(lambda c=command: cli.main([c, str(path)])).get("value") == 1, command
        err = capsys.readouterr().err
        assert "manifest.json" in err and fragment in err, err


# --- outputs that would change a checkpoint; sources in a framework's layout -----------------


def _intact(path) -> None:
    assert cli.main(["verify", str(path)]) == 0, f"{path} was changed"


@pytest.mark.parametrize("to", ["lightning", "hf", "dcp"])
def test_convert_never_writes_into_its_source_or_another_checkpoint(runs, tmp_path, capsys, to):
    # The output path is the source's manifest, a path inside the source, or inside another
    # (copied) GoCkpt checkpoint, directly or through a symlink: refused, both left as they were.
    other = tmp_path / "other.ckpt"
    shutil.copytree(runs["ours"], other)
    (tmp_path / "link").symlink_to(other)
    for dst in (runs["ours"] / "manifest.json", runs["ours"] / "out", other / "model.safetensors",
                tmp_path / "link" / "out", other):
        code, _, err = _in_process(capsys, "convert", str(runs["ours"]), str(dst), "--to", to)
        assert code == 1 and "converting there would change" in err, (dst, err)
    _intact(runs["ours"])
    _intact(other)
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in runs["ours"].iterdir())


def test_convert_of_a_file_onto_itself_is_refused(runs, tmp_path, capsys):
    src = tmp_path / "stock.ckpt"
    shutil.copy(runs["stock"], src)
    code, _, err = _in_process(capsys, "convert", str(src), str(src), "--to", "gockpt")
    assert code == 1 and "is the source" in err, err
    assert src.is_file() and src.read_bytes() == runs["stock"].read_bytes()


def test_to_dcp_writes_a_new_directory_and_never_through_a_link(runs, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    dst = tmp_path / "dcp"
    dst.mkdir()
    (dst / "__0_0.distcp").symlink_to(victim)  # what DCP's writer would open for writing
    code, _, err = _in_process(capsys, "convert", str(runs["ours"]), str(dst), "--to", "dcp")
    assert code == 1 and "not an empty directory" in err, err
    assert victim.read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _in_process(capsys, "convert", str(runs["ours"]), str(empty), "--to", "dcp")
    assert code == 0, err
    assert (empty / ".metadata").is_file()
    assert not [p for p in tmp_path.iterdir() if "gockpt-tmp" in p.name]  # no staging left


def test_a_failed_dcp_write_is_reported_naming_the_output(runs, monkeypatch, capsys):
    # A store whose writes fail (ENOSPC): DCP wraps the error; the command names the output
    # and exits 1 instead of a traceback.
    import errno

    import faultfs

    fault = faultfs.Fault(match="")

    def full(name, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    fault.hook = full
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    dst = f"{faultfs.memory_root()}/dcp-out"
    code, _, err = _in_process(capsys, "convert", str(runs["ours"]), dst, "--to", "dcp")
    assert code == 1, err
    assert "No space left on device" in err and "dcp-out" in err and "Traceback" not in err, err


def test_verify_and_convert_of_a_damaged_checkpoint_never_fall_back_to_one_inside_it(runs, tmp_path, capsys):
    damaged = tmp_path / "step-2"
    shutil.copytree(runs["ours"], damaged)
    shutil.copytree(runs["ours"], damaged / "old")  # a complete checkpoint nested inside
    shard = next(damaged.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4])
    code, out, _ = _in_process(capsys, "verify", str(damaged))
    assert code == 1 and f"FAILED {shard}" in out, out
    code, _, err = _in_process(capsys, "convert", str(damaged), str(tmp_path / "x.ckpt"), "--to", "lightning")
    assert code == 1 and shard.name in err, err
    assert not (tmp_path / "x.ckpt").exists()


def test_a_malformed_sharded_record_is_named_not_a_type_error(runs, tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    shutil.copytree(runs["ours"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["meta"]["sharded"] = {"parts": 5}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    for command in ("inspect", "verify"):
        code, _, err = _in_process(capsys, command, str(bad))
        assert code == 1 and "meta field 'sharded' is malformed" in err and "manifest.json" in err, err


@pytest.mark.parametrize("meta", [{"replay": [1]}, {"replay": "native"}, {"created_unix_s": 1e308},
                                  {"created_unix_s": "yesterday"}])
def test_inspect_shows_malformed_informational_fields_as_unknown(runs, tmp_path, capsys, meta):
    """Fields no loader reads (the replay record, the creation time) malformed: the checkpoint
    still loads, so ``inspect`` still describes it, showing them as unknown (it used to end in
    a traceback)."""
    bad = tmp_path / "odd.ckpt"
    shutil.copytree(runs["ours"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["meta"].update(meta)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = _in_process(capsys, "inspect", str(bad))
    assert code == 0 and "complete        yes" in out and "Traceback" not in err, err
    assert ("none (the state was copied at one step)" if "replay" in meta else "unknown") in out, out


@pytest.fixture(scope="module")
def gockpt_accelerate_folder(tmp_path_factory):
    """An Accelerate save_state folder written by accelerate_gockpt (it has a manifest), and
    the state it holds."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate_gockpt import GoCkptPlugin

    root = tmp_path_factory.mktemp("accelerate_gockpt")
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    GoCkptPlugin(exact_step=True).attach(acc)
    for _ in range(2):
        acc.backward(model(torch.randn(5, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    acc.save_state(str(root / "ckpt"))
    acc.end_training()
    state = {"model": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
             "optimizer": opt.optimizer.state_dict()}
    return root / "ckpt", state


def test_a_folder_written_by_accelerate_gockpt_converts_and_is_not_misread(gockpt_accelerate_folder, tmp_path, capsys):
    folder, want = gockpt_accelerate_folder
    assert (folder / "manifest.json").is_file()
    code, out, err = _in_process(capsys, "verify", str(folder))
    assert code == 0 and "framework's own layout" in out, (out, err)
    code, _, err = _in_process(capsys, "convert", str(folder), str(tmp_path / "g"), "--to", "gockpt")
    assert code == 0, err
    state = gockpt.load_checkpoint(str(tmp_path / "g"))
    assert_bitwise_equal(state.model_state_dict, want["model"], "model")
    assert_bitwise_equal(state.optimizer_state_dicts[0]["state"], want["optimizer"]["state"], "optimizer")
    with pytest.raises(ValueError, match="framework's own folder layout.*load_state"):
        gockpt.load_checkpoint(str(folder))
    # Its files are checked against its manifest before they are read.
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    data = bytearray((damaged / "optimizer.bin").read_bytes())
    data[-3] ^= 1
    (damaged / "optimizer.bin").write_bytes(bytes(data))
    code, _, err = _in_process(capsys, "convert", str(damaged), str(tmp_path / "h"), "--to", "gockpt")
    assert code == 1 and "optimizer.bin" in err and "checksum" in err, err


def test_accelerate_load_without_checksums_still_refuses_a_linked_or_resized_file(gockpt_accelerate_folder, tmp_path):
    from gockpt.folder import check_before_load

    folder, _ = gockpt_accelerate_folder
    for damage in ("symlink", "resized"):
        copy = tmp_path / damage
        shutil.copytree(folder, copy)
        target = copy / "optimizer.bin"
        if damage == "symlink":
            outside = tmp_path / f"outside-{damage}.bin"
            outside.write_bytes(target.read_bytes())
            target.unlink()
            target.symlink_to(outside)
        else:
            target.write_bytes(target.read_bytes() + b"\0")
        with pytest.raises(gockpt.CheckpointCorruptError, match="optimizer.bin"):
            check_before_load(str(copy), verify=False)
    check_before_load(str(folder), verify=False)  # the intact one passes


def test_another_programs_manifest_json_does_not_block_an_output_beside_it(runs, tmp_path, capsys):
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text(json.dumps({"name": "app", "icons": []}))
    code, _, err = _in_process(capsys, "convert", str(runs["ours"]), str(webapp / "out" / "m.ckpt"),
                               "--to", "lightning")
    assert code == 0, err
    (webapp / "manifest.json").write_text("{not json")  # may be a damaged checkpoint's: refused
    code, _, err = _in_process(capsys, "convert", str(runs["ours"]), str(webapp / "out2.ckpt"),
                               "--to", "lightning")
    assert code == 1 and "converting there would change" in err, err


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_verify_of_a_folder_reports_the_newest_checkpoint_damaged(tmp_path, capsys, damage):
    # `verify DIR` checks the checkpoint `latest` names: a truncated shard (no longer complete)
    # fails it as a flipped byte does, instead of passing over it to an older one.
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    with gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync")) as eng:
        for i in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            eng.save(str(tmp_path / f"step-{i}"))
    shard = next((tmp_path / "step-1").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[:-4]
    else:
        data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, err = _in_process(capsys, "verify", str(tmp_path))
    assert code == 1, (out, err)
    assert f"FAILED {shard}" in out
    assert "step-0" not in out
