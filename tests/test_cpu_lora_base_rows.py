"""vLLM-CPU's LoRA ops leave base-model rows alone (``compat.mask_base_rows_in_cpu_lora_ops``).

The CPU build's PyTorch ops pick each row's adapter as ``weights[index]``; a
base-model row's index is -1, which torch reads as the last slot, so base
rows batched beside an adapter's got the last slot's adapter. Here: the ops
as vLLM ships them do that (the cause), and once masked they leave base rows
as they were and give adapter rows exactly the op's own result, through the
CPU Punica wrapper's prefill (``sgmv``) and decode (``bgmv``) paths, its
logits and its embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from skyrl_lora.server import compat

punica_cpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
LoRAMapping = pytest.importorskip("vllm.lora.layers.utils").LoRAMapping

SLOTS, HIDDEN, RANK, VOCAB = 3, 8, 4, 32
#: Four rows: base, slot 0, base, slot 2 (the last slot, the one -1 reads).
INDICES = torch.tensor([-1, 0, -1, 2])
BASE = INDICES < 0


def unmasked(module: ModuleType, name: str) -> Callable[..., None]:
    op = getattr(module, name)
    return getattr(op, "skyrl_leaves_base_rows", op)


@pytest.fixture(scope="module", autouse=True)
def masked() -> None:
    assert compat.mask_base_rows_in_cpu_lora_ops()


def weights(out: int, inp: int, seed: int) -> torch.Tensor:
    """Every slot filled: (slots, 1, out, in), as the LoRA layers stack them."""
    return torch.randn(SLOTS, 1, out, inp, generator=torch.Generator().manual_seed(seed))


def term(x: torch.Tensor, w: torch.Tensor, slot: int) -> torch.Tensor:
    return x @ w[slot, 0].T


def test_vllms_cpu_ops_give_base_rows_the_last_slots_adapter() -> None:
    """The cause, on the ops as vLLM-CPU ships them (if this fails, vLLM
    fixed it and the mask may go)."""
    x, b = torch.randn(4, RANK), weights(6, RANK, 1)
    y = torch.zeros(4, 6)
    unmasked(punica_cpu, "bgmv_expand")(x, b, y, INDICES, True)
    assert torch.allclose(y[0], term(x[0], b, SLOTS - 1))
    x, a = torch.randn(4, HIDDEN), weights(RANK, HIDDEN, 2)
    y = torch.zeros(4, RANK)
    unmasked(lora_ops, "bgmv_shrink")(x, a, y, INDICES, 1.0)  # what sgmv_shrink calls
    assert torch.allclose(y[2], term(x[2], a, SLOTS - 1))


OPS: list[tuple[str, Callable[[torch.Tensor], tuple[Any, ...]], int, int]] = [
    ("bgmv_shrink", lambda i: (i, 0.5), HIDDEN, RANK),
    ("bgmv_expand", lambda i: (i, True), RANK, 6),
    ("bgmv_expand", lambda i: (i, False), RANK, 6),
    ("bgmv_expand_slice", lambda i: (i, 2, 6, True), RANK, 6),
    ("bgmv_expand_slice", lambda i: (i, 2, 6, False), RANK, 6),
]


@pytest.mark.parametrize("home", [lora_ops, punica_cpu], ids=["lora_ops", "punica_cpu"])
@pytest.mark.parametrize(
    ("name", "rest", "inp", "out"),
    OPS,
    ids=["shrink", "expand-add", "expand-set", "expand_slice-add", "expand_slice-set"],
)
def test_masked_ops_leave_base_rows_and_match_the_op_on_adapter_rows(
    home: ModuleType,
    name: str,
    rest: Callable[[torch.Tensor], tuple[Any, ...]],
    inp: int,
    out: int,
) -> None:
    x, w = torch.randn(4, inp), weights(out, inp, 3)
    width = 10 if "slice" in name else out
    before = torch.randn(4, width)
    ours, theirs = before.clone(), before.clone()
    getattr(home, name)(x, w, ours, *rest(INDICES))
    unmasked(home, name)(x, w, theirs, *rest(INDICES))
    assert torch.equal(ours[BASE], before[BASE])
    assert torch.equal(ours[~BASE], theirs[~BASE])


def wrapper(prefill: bool, token_slots: list[int], prompt_slots: list[int]) -> Any:
    """A CPU Punica wrapper for one step; slot s holds adapter id s + 1, -1 is the base model."""
    punica = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    ids = tuple(s + 1 for s in token_slots)  # -1 -> 0: no adapter
    punica.update_metadata(
        LoRAMapping(ids, tuple(s + 1 for s in prompt_slots), is_prefill=prefill),
        [1, 2, 3],
        SLOTS,
        VOCAB,
    )
    return punica


#: A prefill of two requests (3 base tokens, 2 of slot 2) and a decode step of four.
STEPS = [
    (True, [-1, -1, -1, 2, 2], [-1, 2]),
    (False, [-1, 0, -1, 2], [-1, 0, -1, 2]),
]


@pytest.mark.parametrize(("prefill", "tokens", "prompts"), STEPS, ids=["prefill", "decode"])
def test_the_cpu_wrapper_applies_no_adapter_to_base_rows(
    prefill: bool, tokens: list[int], prompts: list[int]
) -> None:
    punica = wrapper(prefill, tokens, prompts)
    assert punica.is_prefill == prefill and not punica.no_lora
    slices = (6, 2, 2)  # a packed layer (q, k, v)
    a = tuple(weights(RANK, HIDDEN, 10 + i) for i in range(3))
    b = tuple(weights(n, RANK, 20 + i) for i, n in enumerate(slices))
    x, y0 = torch.randn(len(tokens), HIDDEN), torch.randn(len(tokens), sum(slices))
    y = y0.clone()
    punica.add_lora_linear(y, x, a, b, 0.5, slices)
    for row, slot in enumerate(tokens):
        if slot < 0:
            assert torch.equal(y[row], y0[row])
            continue
        want = torch.cat([0.5 * term(term(x[row], a[i], slot), b[i], slot) for i in range(3)])
        assert torch.allclose(y[row], y0[row] + want, atol=1e-5)

    # Embeddings: the expand alone, rows of the LoRA A lookup.
    e, e0 = torch.randn(len(tokens), RANK), torch.randn(len(tokens), 6)
    y = e0.clone()
    punica.add_lora_embedding(y, e, weights(6, RANK, 30))
    assert torch.equal(y[torch.tensor(tokens) < 0], e0[torch.tensor(tokens) < 0])

    # Logits: one row per sampled request.
    h, l0 = torch.randn(len(prompts), HIDDEN), torch.randn(len(prompts), VOCAB)
    y = l0.clone()
    punica.add_lora_logits(y, h, weights(RANK, HIDDEN, 40), weights(VOCAB, RANK, 41), 1.0)
    base = torch.tensor(prompts) < 0
    assert torch.equal(y[base], l0[base]) and not torch.equal(y[~base], l0[~base])


def test_masking_again_changes_nothing() -> None:
    ops = [getattr(m, n) for m in (lora_ops, punica_cpu) for n in ("bgmv_shrink", "bgmv_expand")]
    assert compat.mask_base_rows_in_cpu_lora_ops()
    assert [
        getattr(m, n) for m in (lora_ops, punica_cpu) for n in ("bgmv_shrink", "bgmv_expand")
    ] == ops
