"""Which module the engine checkpoints, and how its keys map onto Accelerate's files."""

from __future__ import annotations

from torch import nn


def engine_model(
    wrapped: list[nn.Module], unwrapped: list[nn.Module]
) -> tuple[nn.Module, dict[str, tuple[int, str]]]:
    """The module the engine checkpoints, and its keys -> (model index, Accelerate's key).

    Accelerate saves ``state_dict()`` of each model in ``accelerator._models`` (the model as
    given to ``prepare``; DDP wraps it afterwards, a compile wrapper may stay and prefix the
    keys); the engine sees ``unwrap_model`` of it. A prefix between the two is found by tensor
    identity. Several models are checkpointed as one ``ModuleList`` (keys ``"<i>.<key>"``).

    Args:
        wrapped: ``accelerator._models``.
        unwrapped: ``accelerator.unwrap_model`` of each.

    Returns:
        ``(module, key_map)``: the module for :class:`gockpt.Engine` and, per engine key, the
        model index and the key Accelerate writes.

    Raises:
        ValueError: a key of the unwrapped model without a counterpart (names the key).
    """
    key_map: dict[str, tuple[int, str]] = {}
    for i, (w, u) in enumerate(zip(wrapped, unwrapped, strict=True)):
        wsd, usd = w.state_dict(keep_vars=True), u.state_dict(keep_vars=True)
        prefix = ""
        if usd and set(wsd) != set(usd):
            k0, t0 = next(iter(usd.items()))
            hits = [k for k, t in wsd.items() if t is t0 and k.endswith(k0)]
            prefix = hits[0][: -len(k0)] if hits else ""
        for k in usd:
            if prefix + k not in wsd:
                raise ValueError(f"model {i}: key {k!r} of the unwrapped model is not in the "
                                 f"prepared model's state_dict (prefix {prefix!r})")
            key_map[k if len(wrapped) == 1 else f"{i}.{k}"] = (i, prefix + k)
    if len(unwrapped) == 1:
        return unwrapped[0], key_map
    return nn.ModuleList(unwrapped), key_map
