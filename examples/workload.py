"""The examples' workload: real text as byte tokens, and a small Llama built from a config.

Shared by ``train_lightning.py``, ``train_accelerate.py`` and ``benchmark.py`` so that the demos
and the benchmark train the same model on the same data. Nothing is downloaded: the default text
is the documentation that ships with every Python (``pydoc_data.topics``) and the model is built
from a ``LlamaConfig`` with random weights.

Typical use::

    train, val = text_datasets(seq_len=64)
    model, loss_fn = build_model("small", seed=0)
    optimizer = make_optimizer(model)
    for batch in make_dataloader(train, batch_size=8, seed=0):  # batch: (B, seq_len + 1) int64
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256
"""Byte-level tokens: one token per UTF-8 byte, ids 0..255, no special tokens."""

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
"""Files read from a ``--data`` folder (recursively, in sorted path order)."""

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Size of a Llama built by :func:`build_model`, with a batch that suits it."""

    hidden_size: int
    """Width of the residual stream."""

    intermediate_size: int
    """Width of the SwiGLU MLP."""

    num_hidden_layers: int
    """Transformer blocks."""

    num_attention_heads: int
    """Attention heads (as many key/value heads: no grouped-query attention)."""

    seq_len: int
    """Tokens a window predicts; a window holds ``seq_len + 1`` tokens."""

    batch_size: int
    """Windows per optimizer step."""


# fmt: off
PRESETS: dict[str, Preset] = {
    # ~0.1 M parameters: tests and smoke runs, milliseconds per step.
    "tiny": Preset(hidden_size=48, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, seq_len=32, batch_size=4),
    # ~3.3 M parameters (~40 MB checkpoint with AdamW state): the demos.
    "small": Preset(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, seq_len=64, batch_size=8),
    # ~25.6 M parameters: 12 bytes per parameter (fp32 weights + two AdamW moments) give a
    # ~307 MB checkpoint; one step takes ~0.2-0.3 s on one core of a 2-core VM (fused AdamW).
    "bench": Preset(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, seq_len=64, batch_size=1),
}
# fmt: on


def load_text(path: str | None = None) -> str:
    """Reads the training text.

    Args:
        path: A text file, or a folder whose ``*.txt``/``*.md``/``*.py``/``*.rst`` files are
            read recursively in sorted order. ``None``: Python's own documentation topics
            (``pydoc_data.topics``), joined in sorted key order.

    Returns:
        The text; the same string on every call with the same argument.

    Raises:
        FileNotFoundError: ``path`` does not exist, or a folder holds no text files.
    """
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(f"{key}\n\n{topics[key]}" for key in sorted(topics))
    root = Path(path)
    if root.is_file():
        return root.read_text(encoding="utf-8", errors="replace")
    if not root.is_dir():
        raise FileNotFoundError(f"no text file or folder at {path!r}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no {'/'.join(TEXT_SUFFIXES)} files under {path!r}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def encode(text: str) -> torch.Tensor:
    """Returns the UTF-8 bytes of ``text`` as token ids: shape (n,), int64, values in [0, 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """Inverse of :func:`encode` for ids of any shape (flattened); invalid UTF-8 is replaced."""
    return bytes(ids.flatten().to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class TokenWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus the next-token target).

    Args:
        tokens: Token ids, shape (n,), int64.
        seq_len: Tokens a window predicts; window ``i`` covers ``tokens[i*seq_len : (i+1)*seq_len + 1]``.

    Raises:
        ValueError: ``seq_len < 1`` or fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(
                f"need a 1-D tensor of >= {seq_len + 1} tokens, got {tuple(tokens.shape)}"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]  # (seq_len + 1,) int64


def text_datasets(
    path: str | None = None, *, seq_len: int = 64, val_fraction: float = 0.05
) -> tuple[TokenWindows, TokenWindows]:
    """Splits the text of :func:`load_text` into a training and a validation set.

    The split is by position, not random: the first ``1 - val_fraction`` of the tokens train,
    the rest validate, so it is the same on every machine.

    Returns:
        ``(train, val)``, each yielding (seq_len + 1,) int64 windows.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1), or a part too short for one window.
        FileNotFoundError: as :func:`load_text`.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tokens = encode(load_text(path))
    cut = tokens.numel() - math.ceil(tokens.numel() * val_fraction)
    val = tokens[cut:] if cut < tokens.numel() else tokens[-(seq_len + 1) :]
    return TokenWindows(tokens[:cut], seq_len), TokenWindows(val, seq_len)


def make_dataloader(
    dataset: Dataset[torch.Tensor], batch_size: int, *, shuffle: bool = True, seed: int = 0
) -> DataLoader[torch.Tensor]:
    """A loader of (batch_size, seq_len + 1) int64 batches; the order depends only on ``seed``.

    Incomplete last batches are dropped so every step sees the same shape.
    """
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True, generator=generator
    )


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch`` (B, T + 1) int64; returns a scalar fp32 tensor.

    ``model`` may be a wrapper (DDP, Lightning) that forwards ``input_ids``/``labels`` to a
    ``LlamaForCausalLM``, which shifts the labels by one position itself.
    """
    return model(input_ids=batch, labels=batch).loss


def build_model(preset: str = "small", *, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """Builds a randomly initialised byte-level ``LlamaForCausalLM`` (no download).

    The weights depend only on ``preset`` and ``seed``; the global torch RNG is left untouched.
    The KV cache is off (``use_cache=False``) and there is no dropout, so a training step is a
    deterministic function of weights and batch on CPU.

    Args:
        preset: A key of :data:`PRESETS`.
        seed: Seed of the weight initialisation.

    Returns:
        ``(model, loss_fn)``: the model in training mode (fp32, CPU) and :func:`lm_loss`.

    Raises:
        KeyError: unknown preset.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_attention_heads,
        max_position_embeddings=max(1024, p.seq_len + 1),
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.train()
    return model, lm_loss


def make_optimizer(
    model: nn.Module, *, lr: float = 1e-3, weight_decay: float = 0.1
) -> torch.optim.AdamW:
    """AdamW over all parameters, with the fused kernel (the fastest torch one on CPU)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


# ---------------------------------------------------------------- training set-ups (issue 14)
TrainStep = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor], torch.Tensor]
"""``step(model, optimizer, batch) -> loss``: forward, backward, update and
``zero_grad(set_to_none=True)``; a checkpoint may be requested right after it returns."""

WORKLOADS = ("fp32", "bf16-autocast", "bf16-master", "lora")
"""Training set-ups whose gradients are a different share of the checkpointed state:

- ``fp32``: fp32 weights and AdamW state; gradients (fp32) are 4 of 12 bytes per parameter.
- ``bf16-autocast``: the same tensors, forward and backward under ``torch.autocast`` (bf16):
  still 4 of 12 bytes.
- ``bf16-master``: bf16 weights in the model, fp32 master weights and AdamW state in the
  optimizer (GoCkpt's mixed-precision setting: 2 + 12 bytes per parameter). The optimizer steps
  the masters with their fp32 gradients (4 bytes) and the bf16 weights are cast from them.
- ``lora``: the ``fp32`` model frozen, with trainable rank-8 adapters on every linear layer of
  its decoder blocks (LoRA); the optimizer holds all parameters, and only the adapters get
  gradients and AdamW state.
"""


class LoRALinear(nn.Module):
    """``base(x) + (x @ A.T @ B.T) * alpha / rank`` with ``base`` frozen (LoRA, Hu et al. 2021).

    ``A`` (rank, in) starts small and random, ``B`` (out, rank) at zero, so the wrapped layer
    starts equal to ``base``.
    """

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _autocast_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def state_nbytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the training state a checkpoint holds: the model's ``state_dict``, optimizer
    parameters outside the model (``bf16-master``'s fp32 masters) and the optimizer's state
    tensors (after the first step; 0 of them before)."""
    model_state = model.state_dict().values()
    in_model = {t.data_ptr() for t in model_state}
    tensors = [*model_state]
    tensors += [p for g in optimizer.param_groups for p in g["params"] if p.data_ptr() not in in_model]
    tensors += [t for st in optimizer.state_dict()["state"].values() for t in st.values()
                if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def build_training(
    workload: str = "fp32", preset: str = "small", *, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer, TrainStep]:
    """A model, its optimizer and its training step for one of :data:`WORKLOADS`.

    ``fp32`` is :func:`build_model` with :func:`make_optimizer` and a plain step. The weights
    depend only on ``preset`` and ``seed`` (adapters included; the global torch RNG is left
    untouched).

    Returns:
        ``(model, optimizer, step)``; call ``step(model, optimizer, batch)`` with the model and
        optimizer a framework may have wrapped (``batch``: (B, seq_len + 1) int64).

    Raises:
        KeyError: unknown workload or preset.
    """
    if workload not in WORKLOADS:
        raise KeyError(f"unknown workload {workload!r}; choose one of {list(WORKLOADS)}")
    model, _ = build_model(preset, seed=seed)
    if workload == "fp32":
        return model, make_optimizer(model), _plain_step
    if workload == "bf16-autocast":
        return model, make_optimizer(model), _autocast_step
    if workload == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            for layer in model.model.layers:
                for parent in (layer.self_attn, layer.mlp):
                    for name, child in list(parent.named_children()):
                        if isinstance(child, nn.Linear):
                            setattr(parent, name, LoRALinear(child))
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
        return model, make_optimizer(model), _plain_step
    # bf16-master: the optimizer owns fp32 copies; the model's bf16 weights are cast from them.
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    weights = list(model.parameters())
    for m in masters:
        m.requires_grad_(True)
    optimizer = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, fused=True)

    def master_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                    batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, batch)
        loss.backward()
        for w, m in zip(weights, masters, strict=True):
            m.grad = w.grad.float()  # exact: every bf16 value is an fp32 value
            w.grad = None
        optimizer.step()
        with torch.no_grad():
            for w, m in zip(weights, masters, strict=True):
                w.copy_(m)  # round to nearest bf16
        optimizer.zero_grad(set_to_none=True)
        return loss

    return model, optimizer, master_step


def bench_training(
    workload: str = "fp32", preset: str = "bench", *, nice: int | None = None,
    keep_denormals: bool = False, seed: int = 0,
) -> tuple[nn.Module, torch.optim.Optimizer, TrainStep, Iterator[torch.Tensor]]:
    """The training process of a side-by-side benchmark: :func:`build_training`, one training
    thread, and an endless stream of batches.

    Args:
        workload, preset, seed: as :func:`build_training`.
        nice: this process's niceness (a value below the current one needs root), or None.
        keep_denormals: False flushes denormal floats to zero (``torch.set_flush_denormal``):
            after some 500 steps this model's CPU training reaches denormal values and its
            steps slow down by half over the next few hundred, a drift larger than what the
            benchmarks measure.

    Returns:
        ``(model, optimizer, step, batches)``; ``next(batches)`` is a (B, seq_len + 1) int64
        batch, the loader started over at its end.
    """
    if nice is not None:
        os.nice(nice - os.nice(0))
    torch.set_num_threads(1)
    if not keep_denormals:
        torch.set_flush_denormal(True)
    model, optimizer, step = build_training(workload, preset, seed=seed)
    train, _ = text_datasets(seq_len=PRESETS[preset].seq_len)
    loader = make_dataloader(train, PRESETS[preset].batch_size, seed=seed)

    def batches() -> Iterator[torch.Tensor]:
        while True:
            yield from loader

    return model, optimizer, step, batches()
