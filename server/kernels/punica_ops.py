"""The grouped kernels behind vLLM's LoRA op signatures, and their installation.

``PunicaWrapperGPU`` calls two module-level ops for every LoRA layer of a
step: ``lora_shrink`` (the tokens times each one's adapter A) and
``lora_expand`` (that times B, added to the layer's output). The functions
here take exactly their arguments (:data:`..compat.LORA_SHRINK_PARAMETERS`),
run :mod:`.grouped_lora` where it takes the layer's weights and vLLM's own
kernel where it does not (packed layers of more than three slices), and
:func:`install` puts them in the wrapper's place. It also makes the
wrapper fill the step's row-chunk plan (:func:`fill_step_plan`) right after
vLLM prepares the step's metadata, once per step, so that none of the
step's 256 launches works out its rows again.

Installed in each GPU worker as vLLM imports our worker extension, before
the model is compiled and its CUDA graphs are captured
(``SKYRL_LORA_KERNELS``: ``grouped``, the default, or ``vllm`` to keep
vLLM's; ``serve --lora-kernels``). No ``from __future__ import
annotations`` here: the ops' schemas are read from these annotations.
"""

import logging
import os
from collections.abc import Callable

import torch

from .. import compat
from . import GROUPED, KERNELS_ENV, VLLM
from .grouped_lora import (
    RowChunkPlan,
    fill_plan,
    grouped_expand,
    grouped_shrink,
    new_plan,
    supports,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GROUPED", "KERNELS_ENV", "VLLM", "fill_step_plan", "install", "installed", "lora_expand",
    "lora_shrink",
]  # fmt: skip
#: The torch library our ops are registered in (``torch.ops.skyrl_lora``).
LIBRARY = "skyrl_lora"

_vllm_ops: tuple[Callable[..., None], Callable[..., None]] | None = None
#: Each Punica wrapper's step plan, by the address of its token metadata's
#: ``num_tokens_per_lora``: the ops are handed that tensor (whole, where
#: other fields come sliced), and a CUDA graph captured with the plan's
#: tables replays with them, refilled before every step.
_step_plans: dict[int, RowChunkPlan] = {}


def fill_step_plan(wrapper: object) -> None:
    """Fill ``wrapper``'s plan from the metadata vLLM has just prepared for a
    step (its tables made at the first step; nothing to fill in a step
    without adapters, where the ops return at once). The sampler rows'
    metadata, used only by LoRA on the logits, gets none: those launches
    fill a plan of their own."""
    meta = wrapper.token_mapping_meta  # type: ignore[attr-defined]
    counts = meta.num_tokens_per_lora
    plan = _step_plans.get(counts.data_ptr())
    groups = int(meta.active_lora_ids.size(0))
    if plan is None:
        plan = new_plan(int(meta.token_lora_mapping.size(0)), groups, counts.device)
        _step_plans[counts.data_ptr()] = plan
    if bool(meta.no_lora_flag_cpu[0]):
        return
    fill_plan(
        plan, meta.token_indices_sorted_by_lora_ids, counts, meta.lora_token_start_loc,
        meta.active_lora_ids, groups,
    )  # fmt: skip


def lora_shrink(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    scaling: float,
) -> None:
    """vLLM's ``lora_shrink``, by :func:`.grouped_lora.grouped_shrink` where it can."""
    if no_lora_flag_cpu.item():
        return
    if not supports(lora_a_weights) and _vllm_ops is not None:
        _vllm_ops[0](
            inputs, lora_a_weights, output_tensor, token_lora_mapping,
            token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
            lora_ids, no_lora_flag_cpu, num_active_loras, scaling,
        )  # fmt: skip
        return
    grouped_shrink(
        inputs.view(-1, inputs.size(-1)),
        lora_a_weights,
        output_tensor,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        int(num_active_loras.item()),
        scaling,
        plan=_step_plans.get(num_tokens_per_lora.data_ptr()),
    )


def lora_expand(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = False,
) -> None:
    """vLLM's ``lora_expand``, by :func:`.grouped_lora.grouped_expand` where it can."""
    if no_lora_flag_cpu.item():
        return
    if not supports(lora_b_weights) and _vllm_ops is not None:
        _vllm_ops[1](
            inputs, lora_b_weights, output_tensor, token_lora_mapping,
            token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
            lora_ids, no_lora_flag_cpu, num_active_loras, offset_start, add_inputs,
        )  # fmt: skip
        return
    grouped_expand(
        inputs,
        lora_b_weights,
        output_tensor,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        int(num_active_loras.item()),
        offset_start,
        add_inputs,
        plan=_step_plans.get(num_tokens_per_lora.data_ptr()),
    )


def _shrink_fake(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    scaling: float,
) -> None:
    return None


def _expand_fake(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = False,
) -> None:
    return None


def chosen() -> str:
    """The kernels the environment asks for (:data:`KERNELS_ENV`; grouped by default)."""
    value = os.environ.get(KERNELS_ENV, GROUPED).strip().lower() or GROUPED
    if value not in (GROUPED, VLLM):
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected {GROUPED!r} or {VLLM!r}")
    return value


def install() -> bool:
    """Put the grouped kernels in the GPU Punica wrapper's place (once per process).

    False, changing nothing, where the environment asks for vLLM's, where
    no CUDA device is there (the CPU build runs its own LoRA ops), or where
    this vLLM's ops take other arguments than ours.
    """
    global _vllm_ops
    if _vllm_ops is not None:
        return True
    if chosen() != GROUPED or not torch.cuda.is_available():
        return False
    found = compat.punica_lora_ops()
    if found is None:
        logger.warning("vLLM's LoRA ops take other arguments here: kept vLLM's kernels")
        return False
    _vllm_ops = found
    if not compat.replace_punica_lora_ops(
        LIBRARY, lora_shrink, _shrink_fake, lora_expand, _expand_fake
    ):
        _vllm_ops = None
        return False
    planned = compat.after_punica_metadata(fill_step_plan)
    logger.info(
        "LoRA kernels: grouped (%s=%s), row chunks planned %s",
        KERNELS_ENV, GROUPED, "once per step" if planned else "in every launch",
    )  # fmt: skip
    return True


def installed() -> bool:
    """Whether this process's Punica wrapper runs the grouped kernels."""
    return _vllm_ops is not None
