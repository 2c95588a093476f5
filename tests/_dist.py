"""Helpers for the tests' spawned gloo ranks."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def end_rank() -> None:
    """End a spawned rank once its results are written, without a Python-side teardown of its
    gloo groups: destroying a group while the other rank still frees a finished work item (it
    needs the GIL, which a DDP reducer's or FSDP state's dealloc may hold) hangs or aborts at
    random on this torch. Everything the test checks is on disk or asserted already."""
    dist.barrier()
    os._exit(0)


def lightning_rank(rank: int, port: int, world: int = 2) -> None:
    """Set up this process as rank ``rank`` of ``world`` on one node for Lightning, which then
    sees an external launcher (``LOCAL_RANK``) and joins the gloo group at ``port``; one
    thread (two cores for all ranks)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world))
    torch.set_num_threads(1)


# What a rank imports before its test function runs: loaded once in the fork server, so that
# each rank starts in a fraction of a second instead of paying the imports (lightning alone
# takes seconds of CPU, and the suite starts hundreds of ranks on 2 cores).
_PRELOAD = ["torch", "torch.distributed", "gockpt", "lightning.pytorch", "lightning_gockpt"]


def _in_env(env: dict, fn: Callable, *args: Any) -> None:
    # A fork server's child inherits the server's environment, not the test's: restore the
    # test's as it was at the start (what ``start_method="spawn"`` gives a child).
    os.environ.clear()
    os.environ.update(env)
    fn(*args)


def _run_rank(rank: int, env: dict, fn: Callable, *args: Any) -> None:
    _in_env(env, fn, rank, *args)


def _fork_server() -> multiprocessing.context.ForkServerContext:
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts (once)
    return multiprocessing.get_context("forkserver")


def process(fn: Callable, args: tuple = ()) -> multiprocessing.Process:
    """A process (not started) that runs ``fn(*args)``, from a fork server that has imported
    torch, gockpt and lightning already: it starts in a fraction of a second, and is still a
    fresh process (nothing of the test's own process, such as threads, engines or process
    groups, is inherited); the working directory, ``sys.path`` and environment are the test's
    at the call, as under ``start_method="spawn"``. Unlike a spawned process: what the
    preloaded modules read when imported (``OMP_NUM_THREADS`` for torch's thread count) and
    the umask are the server's, and ``atexit`` hooks do not run at its exit (threads'
    ``threading._register_atexit`` hooks do)."""
    return _fork_server().Process(target=_in_env, args=(dict(os.environ), fn, *args))


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (ranks ``0..nprocs-1`` run
    ``fn(rank, *args)``; an error in one is raised here), each rank started as
    :func:`process` starts one."""
    _fork_server()
    mp.start_processes(_run_rank, args=(dict(os.environ), fn, *args), nprocs=nprocs,
                       start_method="forkserver")
