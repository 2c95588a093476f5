"""Which module the engine checkpoints for a framework's wrapped models, and their keys.

A framework saves ``state_dict()`` of the model object it keeps (Accelerate: the model as given
to ``prepare``; a ``torch.compile`` wrapper may stay and prefix its keys with ``_orig_mod.``,
DDP with ``module.``), while the engine sees the unwrapped model. :func:`engine_model` maps the
engine's keys onto the framework's, so a writer stores the tensors under the framework's names
(see :class:`gockpt.writer.TensorFile`).
"""

from __future__ import annotations

from torch import nn

__all__ = ["engine_model"]


def engine_model(
    wrapped: list[nn.Module], unwrapped: list[nn.Module]
) -> tuple[nn.Module, dict[str, tuple[int, str]]]:
    """The module the engine checkpoints, and its keys -> (model index, the wrapper's key).

    A prefix between a wrapper's keys and its unwrapped model's is found by tensor identity
    (the same parameter under both names). Several models are checkpointed as one
    ``ModuleList`` (engine keys ``"<i>.<key>"``).

    Args:
        wrapped: the models as the framework saves them.
        unwrapped: the model inside each (the same object when there is no wrapper).

    Returns:
        ``(module, key_map)``: the module for :class:`gockpt.Engine` and, per engine key, the
        model index and the key the framework writes.

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
                                 f"wrapper's state_dict (prefix {prefix!r})")
            key_map[k if len(wrapped) == 1 else f"{i}.{k}"] = (i, prefix + k)
    if len(unwrapped) == 1:
        return unwrapped[0], key_map
    return nn.ModuleList(unwrapped), key_map
