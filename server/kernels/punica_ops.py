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
step's 256 launches works out its rows again. With ``fused``, the
wrapper's ``add_lora_linear`` (the shrink then the expand of one layer)
becomes one op, :func:`lora_linear`, one launch per layer
(:mod:`.fused_lora`).

Installed in each GPU worker as vLLM imports our worker extension, before
the model is compiled and its CUDA graphs are captured
(``SKYRL_LORA_KERNELS``: ``grouped``, the default, ``fused``, or ``vllm``
to keep vLLM's; ``serve --lora-kernels``). No ``from __future__ import
annotations`` here: the ops' schemas are read from these annotations.
"""

import logging
import os
from collections.abc import Callable

import torch

from .. import compat
from . import FUSED, GROUPED, KERNELS_ENV, VLLM
from .fused_lora import FusedWorkspace, fused_lora, new_workspace
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
    "FUSED", "GROUPED", "KERNELS_ENV", "VLLM", "fill_step_plan", "fused_installed", "install",
    "installed", "lora_expand", "lora_linear", "lora_shrink",
]  # fmt: skip
#: The torch library our ops are registered in (``torch.ops.skyrl_lora``).
LIBRARY = "skyrl_lora"

_vllm_ops: tuple[Callable[..., None], Callable[..., None]] | None = None
#: Each Punica wrapper's step plan, by the address of its token metadata's
#: ``num_tokens_per_lora``: the ops are handed that tensor (whole, where
#: other fields come sliced), and a CUDA graph captured with the plan's
#: tables replays with them, refilled before every step.
_step_plans: dict[int, RowChunkPlan] = {}
#: Each device's workspace for :func:`lora_linear` (grown, never shrunk: a
#: CUDA graph keeps the one it captured, with its own barrier state).
_workspaces: dict[torch.device, FusedWorkspace] = {}
#: Rows a first workspace holds at least (vLLM's profile run, eager and
#: first, asks for its whole token budget anyway).
_WORKSPACE_MIN_TOKENS = 2048
_fused = False


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


def lora_linear(
    output_tensor: torch.Tensor,
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    lora_b_weights: list[torch.Tensor],
    scaling: float,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """vLLM's ``add_lora_linear`` (shrink, then expand adding into the layer's
    output) in one launch (:func:`.fused_lora.fused_lora`); layers the fused
    kernel does not take run :func:`lora_shrink` then :func:`lora_expand`."""
    if no_lora_flag_cpu.item():
        return
    rows = inputs.view(-1, inputs.size(-1))
    meta = (
        token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
        lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras,
    )  # fmt: skip
    slices, tokens = len(lora_a_weights), rows.size(0)
    rank = int(lora_a_weights[0].size(-2))
    if not (supports(lora_a_weights) and supports(lora_b_weights)):
        buffer = torch.empty((slices, tokens, rank), dtype=torch.float32, device=rows.device)
        lora_shrink(rows, lora_a_weights, buffer, *meta, scaling)
        lora_expand(buffer, lora_b_weights, output_tensor, *meta, 0, add_inputs)
        return
    fused_lora(
        output_tensor, rows, lora_a_weights, lora_b_weights, scaling,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
        int(num_active_loras.item()), _workspace(rows.device, slices, tokens, rank),
        add_inputs=add_inputs, plan=_step_plans.get(num_tokens_per_lora.data_ptr()),
    )  # fmt: skip


def _workspace(device: torch.device, slices: int, tokens: int, rank: int) -> FusedWorkspace:
    """The device's fused-kernel workspace, a larger one where this launch needs it."""
    workspace = _workspaces.get(device)
    if workspace is None or not workspace.fits(slices, tokens, rank):
        rows = max(tokens, _WORKSPACE_MIN_TOKENS)
        if workspace is not None:
            rows = max(rows, workspace.half // (3 * max(rank, 1)))
        workspace = new_workspace(rows, rank, device)
        _workspaces[device] = workspace
    return workspace


def _linear_fake(
    output_tensor: torch.Tensor,
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    lora_b_weights: list[torch.Tensor],
    scaling: float,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    return None


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
    if value not in (GROUPED, FUSED, VLLM):
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected {GROUPED!r}, {FUSED!r} or {VLLM!r}")
    return value


def install() -> bool:
    """Put the grouped kernels in the GPU Punica wrapper's place (once per process).

    False, changing nothing, where the environment asks for vLLM's, where
    no CUDA device is there (the CPU build runs its own LoRA ops), or where
    this vLLM's ops take other arguments than ours.
    """
    global _vllm_ops, _fused
    if _vllm_ops is not None:
        return True
    if chosen() == VLLM or not torch.cuda.is_available():
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
    if chosen() == FUSED:
        _fused = compat.replace_punica_add_lora_linear(LIBRARY, lora_linear, _linear_fake)
    logger.info(
        "LoRA kernels: grouped (%s=%s), row chunks planned %s, %s",
        KERNELS_ENV, chosen(), "once per step" if planned else "in every launch",
        "each layer in one launch" if _fused else "shrink and expand apart",
    )  # fmt: skip
    return True


def installed() -> bool:
    """Whether this process's Punica wrapper runs the grouped kernels."""
    return _vllm_ops is not None


def fused_installed() -> bool:
    """Whether this process's Punica wrapper runs each LoRA layer in one launch."""
    return _fused
