"""gockpt.torchfile: torch.save's own bytes from a host snapshot, the bulk copied outside the GIL."""

from __future__ import annotations

import collections
import io
import zipfile

import pytest
import torch

from gockpt.snapshot import to_bytes
from gockpt.torchfile import shared_storage, torch_file

Pair = collections.namedtuple("Pair", "first second")


def _snapshot_like(state: dict) -> tuple[dict, torch.Tensor]:
    """``state`` with every tensor of more than one element moved into one host slot (views
    of it, as the engine's snapshot hands an optimizer state to a writer)."""
    tensors = [t for s in state["state"].values() for t in s.values() if t.dim() > 0]
    slot = torch.empty(sum(t.numel() for t in tensors))
    off, out = 0, {}
    for k, s in state["state"].items():
        out[k] = {}
        for name, t in s.items():
            if t.dim() > 0:
                out[k][name] = slot[off: off + t.numel()].view(t.shape).copy_(t)
                off += t.numel()
            else:
                out[k][name] = t.clone()
    return {"state": out, "param_groups": state["param_groups"]}, slot


def _odd_tree() -> dict:
    slot = torch.randn(1000)
    w = torch.randn(4, 4)
    return {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": slot[:16].view(4, 4), "exp_avg_sq": slot[16:32].view(4, 4)},
            1: {"bf16": torch.randn(5, dtype=torch.bfloat16), "empty": torch.empty(0, 3), "transposed": w.t(),
                "int8": torch.arange(7, dtype=torch.int8), "bool": torch.tensor([True, False]),
                "complex": torch.randn(3, dtype=torch.complex64),
                "tied": slot[:16].view(4, 4),  # the same place as exp_avg: stored once
                "int32_alias": slot[:16].view(torch.int32)},  # same address, another dtype
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0, 1]}],
        "nested": [Pair(slot[100:104], (slot[200:202], "x"))],
    }


def test_bytes_are_those_of_torch_save_of_own_storage():
    tree = _odd_tree()
    out = torch_file(tree)
    assert isinstance(out, memoryview) and out.ndim == 1 and out.format == "B"
    assert bytes(out) == to_bytes(tree)  # byte for byte: headers, CRC-32s, serialization_id
    assert zipfile.ZipFile(io.BytesIO(bytes(out))).testzip() is None
    with torch.serialization.safe_globals([Pair]):
        loaded = torch.load(io.BytesIO(bytes(out)), weights_only=True)
    assert loaded["state"][1]["tied"] is loaded["state"][0]["exp_avg"]
    assert torch.equal(loaded["state"][1]["int32_alias"], tree["state"][0]["exp_avg"].reshape(-1).view(torch.int32))
    assert isinstance(loaded["nested"][0], Pair) and torch.equal(loaded["nested"][0][1][0], tree["nested"][0][1][0])


def test_optimizer_state_loads_bit_identical_to_a_plain_torch_save():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
    live = opt.state_dict()
    snap, _ = _snapshot_like(live)
    stock = io.BytesIO()
    torch.save(live, stock)
    want = torch.load(io.BytesIO(stock.getvalue()), weights_only=True)
    got = torch.load(io.BytesIO(bytes(torch_file(snap))), weights_only=True)
    assert list(got["state"]) == list(want["state"]) and got["param_groups"] == want["param_groups"]
    for k, s in want["state"].items():
        assert list(got["state"][k]) == list(s)
        for name, t in s.items():
            g = got["state"][k][name]
            assert (g.dtype, g.shape, g.stride()) == (t.dtype, t.shape, t.stride())
            assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (k, name)
            assert g.untyped_storage().nbytes() == t.untyped_storage().nbytes()  # not the whole slot


def test_shared_storage_shares_memory_instead_of_copying():
    tree = _odd_tree()
    shared = shared_storage(tree)
    src, dst = tree["state"][0]["exp_avg"], shared["state"][0]["exp_avg"]
    assert dst.data_ptr() == src.data_ptr() and dst.untyped_storage().nbytes() == src.numel() * 4
    assert shared["state"][1]["tied"] is dst
    # Not contiguous, or another dtype at an address already taken: a copy of its own.
    for name in ("transposed", "int32_alias"):
        got, orig = shared["state"][1][name], tree["state"][1][name]
        assert got.data_ptr() != orig.data_ptr() and got.is_contiguous() and torch.equal(got, orig)


def test_the_buffer_grows_past_its_estimate():
    tree = {"t": torch.randn(10), "meta": "x" * (1 << 20)}  # a pickle far over the estimate
    assert bytes(torch_file(tree)) == to_bytes(tree)


def test_what_torch_save_refuses_is_raised():
    with pytest.raises(Exception, match="pickle|Can't|lambda"):
        torch_file({"t": torch.randn(3), "f": lambda: None})


def test_sparse_tensors_are_written_as_torch_save_writes_them():
    # A sparse embedding's momentum buffer under SGD (Accelerate's optimizer.bin): torch_file
    # raised (a sparse tensor has no storage) and no folder was written.
    sparse = torch.randn(6, 3).to_sparse()
    tree = {"state": {0: {"momentum_buffer": sparse}, 1: {"momentum_buffer": torch.randn(4)}},
            "again": sparse, "csr": torch.eye(3).to_sparse_csr()}
    assert bytes(torch_file(tree)) == to_bytes(tree)
    back = torch.load(io.BytesIO(bytes(torch_file(tree))), weights_only=True)
    assert back["again"] is back["state"][0]["momentum_buffer"]  # one object, as saved
    assert torch.equal(back["again"].to_dense(), sparse.to_dense())
    assert torch.equal(back["csr"].to_dense(), torch.eye(3))
