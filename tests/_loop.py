"""A tiny deterministic training loop that exercises everything a checkpoint must hold.

Clipping, a per-step LR scheduler, bf16 autocast, gradient accumulation over two micro-batches,
a GradScaler-skipped step (an injected inf), dropout (RNG) and BatchNorm (buffers). Used by the
engine tests in-process and by the crash test in a child process (:func:`crash_child`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad_max": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=1e-2),
    # Fused kernels scale for GradScaler themselves (``_step_supports_amp_scaling``): they are
    # stepped on a skipped iteration too, and leave the state as it was.
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad_fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


class Net(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.1)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, 8, bias=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        h = self.drop(torch.relu(self.norm(self.embed(x))))
        return self.out(torch.relu(self.hidden(h)))


def make(opt_name: str = "adamw", seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return model, opt, sched, scaler


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What a blocking save holds right now (deep copies)."""
    return {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}


def train(model, opt, sched, scaler, num_iters: int, *, skip_iter: int = 5, on_step_end=None,
          data_seed: int = 1, start_iter: int = 0, unscale: bool = True):
    """Run ``num_iters`` iterations; calls ``on_step_end(it)`` at each step boundary.
    ``unscale=False``: no ``scaler.unscale_`` and no clipping, as Lightning steps an optimizer
    that scales for GradScaler itself (its fused kernel unscales the gradients)."""
    g = torch.Generator().manual_seed(data_seed)
    data = torch.randn(4096, 2, 16, 8, generator=g)
    for it in range(start_iter, num_iters):
        for micro in range(2):
            x = data[it % len(data), micro]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean() / 2
            scaler.scale(loss).backward()
        if it == skip_iter:
            next(model.parameters()).grad[0, 0] = float("inf")
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        if on_step_end is not None:
            on_step_end(it)


def assert_state_equal(got: dict, want: dict, where: str = "") -> None:
    """Bit-for-bit equality of two state_dict-shaped nested structures."""
    assert type(got) is type(want) or (isinstance(got, dict) and isinstance(want, dict)), where
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                           want.view(-1).view(torch.uint8) if want.numel() else want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, set(got) ^ set(want)))}"
        for k in want:
            assert_state_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_state_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want or (got != got and want != want), f"{where}: {got!r} != {want!r}"


def crash_child(root: str, mode: str, report) -> None:
    """The crash test's child: train forever, saving every other step into six rotating
    folders, calling ``report(step)`` with each checkpoint's captured step once it is durable."""
    import gockpt

    torch.set_num_threads(1)
    model, opt, sched, scaler = make("adamw")
    eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode=mode, min_overlap_steps=2,
                                                        max_overlap_steps=3, max_shard_bytes=4096))
    handles = []

    def step_end(it: int) -> None:
        eng.step_end()
        if it % 2 == 0:
            handles.append(eng.save(f"{root}/ckpt-{it % 6}", state_fn=lambda: {"it": it}))
        for h in [h for h in handles if h.done()]:
            handles.remove(h)
            report(h.result().captured_step)

    train(model, opt, sched, scaler, 10**9, on_step_end=step_end)

