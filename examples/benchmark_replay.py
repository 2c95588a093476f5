"""CPU replay throughput: the native AdamW kernel against torch.optim.AdamW and memory bandwidth.

One command (``python examples/benchmark_replay.py``) prints, for 1 and 2 threads, the median
time of one AdamW update of the same ``--numel`` fp32 parameters (state and gradient alike) by

- ``native``: the compiled kernel variant the self-check finds bit-exact for CPU AdamW here
  (``gockpt._native``, GoCkpt §4.3 replay), ``num_threads`` = the thread count;
- ``torch.optim``: ``torch.optim.AdamW(...).step()`` (its CPU default, the single-tensor path),
  ``torch.set_num_threads`` = the thread count;
- ``torch replay``: :class:`gockpt.replay.TorchReplay`, the fallback backend (the same torch
  arithmetic, plus building a throw-away optimizer per call);

next to this machine's memory bandwidth measured in the same run on buffers of the same total
size, counted as read + write bytes: ``dst.copy_(src)`` (a large torch copy) and
``buf.mul_(1.0)`` (an in-place pass which, like the kernel, writes back lines it has just read
and so pays no read-for-ownership). The larger of the two is the bound.

Throughput is parameters per second and GB/s of memory touched: per parameter the update reads
the parameter, gradient, exp_avg and exp_avg_sq and writes the parameter, exp_avg and
exp_avg_sq (7 x 4 bytes with fp32 gradients; 26 bytes with ``--grad-dtype bf16``). "of bw" is
that rate over the bound, the limit for a kernel that touches each byte once.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch.optim import AdamW

from gockpt import _native, selfcheck
from gockpt.replay import TorchReplay


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, lazy state, thread start-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="parameters (fp32) per update")
    ap.add_argument("--repeats", type=int, default=7, help="timed repetitions (median printed)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()

    if not _native.available():
        raise SystemExit("gockpt._gockpt_native is not built: pip install -e . with a C++ compiler")
    n = args.numel
    grad_dtype = torch.float32 if args.grad_dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)  # what the kernel reads
    fp32_grad = grad.float()  # what torch.optim reads
    opt = AdamW([param], lr=1e-3)
    param.grad = fp32_grad
    opt.step()  # creates exp_avg / exp_avg_sq
    state = opt.state[param]
    hparams = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    choice = selfcheck.select_backend(opt, "native")
    assert isinstance(choice.backend, _native.NativeReplay)
    exact_variant = choice.backend
    bytes_per_param = 3 * 4 + grad.element_size() + 3 * 4
    touched = n * bytes_per_param
    src = torch.ones(touched // 16, dtype=torch.float64)  # copy: read + write = touched bytes
    dst = torch.zeros_like(src)
    buf_bytes = 2 * src.numel() * 8

    def torch_optim_step() -> None:
        param.grad = fp32_grad  # TorchReplay clears .grad of the tensors it steps
        opt.step()

    print(
        f"AdamW update of {n:,} fp32 parameters, {args.grad_dtype} gradients: "
        f"{bytes_per_param} bytes touched per parameter, {touched / 1e9:.2f} GB per update"
    )
    print(
        f"native variant: {choice.backend.name} (bit-exact vs torch.optim.AdamW on this "
        f"machine: {choice.exact}); isa: {_native.isas()[0]}; median of {args.repeats} runs"
    )
    header = (
        f"{'threads':>7}  {'what':<14} {'ms':>9} {'Mparam/s':>10} {'GB/s':>7} "
        f"{'of bw':>6} {'vs torch':>8}"
    )
    print(header)
    print("-" * len(header))
    saved_threads = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bw_rows = {
                "copy_": _median_s(lambda: dst.copy_(src), args.repeats),
                "mul_ inplace": _median_s(lambda: dst.mul_(1.0), args.repeats),
            }
            bandwidth = buf_bytes / min(bw_rows.values())
            native = _native.NativeReplay(
                recipe=exact_variant.recipe,
                fma=exact_variant.fma,
                sqrt=exact_variant.sqrt,
                num_threads=threads,
            )
            rows = {
                "native": _median_s(
                    functools.partial(native.step, AdamW, hparams, [param], [grad], [state]),
                    args.repeats,
                ),
                "torch.optim": _median_s(torch_optim_step, args.repeats),
                "torch replay": _median_s(
                    lambda: TorchReplay().step(AdamW, hparams, [param], [fp32_grad], [state]),
                    args.repeats,
                ),
            }
            for name, s in bw_rows.items():
                print(
                    f"{threads:>7}  {'bw ' + name:<14} {s * 1e3:>9.2f} {'':>10} "
                    f"{buf_bytes / s / 1e9:>7.2f} {buf_bytes / s / bandwidth:>6.0%}"
                )
            for name, s in rows.items():
                print(
                    f"{threads:>7}  {name:<14} {s * 1e3:>9.2f} {n / s / 1e6:>10.1f} "
                    f"{touched / s / 1e9:>7.2f} {touched / s / bandwidth:>6.0%} "
                    f"{rows['torch.optim'] / s:>7.2f}x"
                )
    finally:
        torch.set_num_threads(saved_threads)


if __name__ == "__main__":
    main()
