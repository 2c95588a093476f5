"""DDP with ``gradient_as_bucket_view=True``: the gradients are views into the reducer's buckets,
which the next backward writes even after ``zero_grad(set_to_none=True)``. A ``gockpt_o``
gradient copy that overlaps the next forward and backward (a slow link, emulated) must finish
before any of them is written: every checkpoint is written and exact.

One process over gloo, spawned (``torch.distributed`` state stays out of the test process).
"""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _loop import assert_state_equal

import gockpt


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, root: str, set_to_none: bool) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)],
                              torch.nn.Linear(128, 512), torch.nn.Linear(512, 128, bias=False))
    # Several buckets, each shared by a few parameters; the last 256 KB weight fills a bucket
    # alone (its gradient is a view of the whole bucket).
    ddp = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True,
                                                    bucket_cap_mb=0.1)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    # Tens of ms per window's gradients: the copy runs into the next backward.
    cfg = gockpt.GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3,
                              host_link_bytes_per_s=40e6)
    eng = gockpt.Engine(net, opt, cfg)
    live, handles = {}, []
    g = torch.Generator().manual_seed(1)
    for it in range(12):
        ddp(torch.randn(32, 128, generator=g)).pow(2).mean().backward()
        assert net[0].weight.grad.untyped_storage().nbytes() > net[0].weight.grad.nbytes
        alone = net[7].weight.grad
        if it >= 1:  # DDP's buckets as rebuilt after the first backward
            assert alone._base is not None and alone.untyped_storage().nbytes() == alone.nbytes
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        eng.step_end()
        live[eng.version] = copy.deepcopy((net.state_dict(), opt.state_dict()))
        if it in (2, 6):
            handles.append(eng.save(f"{root}/ckpt-{it}"))
    eng.close()
    for h in handles:
        m = h.result()  # a torn gradient copy raised CheckpointTornError here
        assert m.mode == "gockpt_o" and m.num_overlap_steps == 3
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[m.captured_step][0], "model")
        assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step][1], "optim")
    dist.destroy_process_group()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_bucket_view_gradients_are_not_written_while_they_are_copied(tmp_path, set_to_none):
    spawn(_worker, args=(_port(), str(tmp_path), set_to_none), nprocs=1)
