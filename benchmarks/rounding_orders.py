"""The first token's log-probabilities with bf16 rounding in a chosen order.

Why: on the random 8B shape, ``serve``'s default and ``--lora-overlap fused``
put one adapter's first greedy logprob 0.2 apart (``docs/gpu.md``), and a
bf16 path sits 0.1-0.3 from float32 whatever it does: a random 32-layer net
carries a rounding difference in one layer to the logits. Float32 alone
(:mod:`benchmarks.greedy_reference`) cannot say which path computes what it
should. This module computes the model as the GPU kernels round, each order
in turn:

- ``float32``: nothing rounded (equals transformers' Llama in float32, tested);
- ``lora_after_round``: bf16 between ops, each GEMM accumulated in float32
  and rounded once, the LoRA's expand added to the rounded base output and
  rounded again (vLLM's expand with ``add_inputs``: ``serve``'s default);
- ``lora_in_accumulator``: the same, but the LoRA term joins the base GEMM's
  float32 accumulator before its one rounding (our fused layer);
- ``float64_accumulate``: ``lora_after_round`` with each base GEMM summed in
  float64 first. It changes only which of the products round up, as another
  GEMM kernel would: its distance from ``lora_after_round`` is the noise
  floor against which the two orders are told apart.

A served path nearer its own order than the noise floor, and farther from the
other, computes what it should. The weights are read from the model's
safetensors (bf16), the adapter's from PEFT's file; the Llama is written out
here (RMSNorm, rotary, grouped-query attention, SwiGLU), small enough to read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ORDERS = ("float32", "lora_after_round", "lora_in_accumulator", "float64_accumulate")


def first_token_orders(
    model_dir: Path, prompt: list[int], adapter_dir: Path | None = None, top: int = 5
) -> dict[str, dict[str, dict[int, float]]]:
    """``{"base" | "adapter": {order: {token: logprob}}}``: the ``top`` tokens
    after ``prompt`` in each of :data:`ORDERS` (on the GPU where there is one)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _Llama(model_dir, device)
    found = {"base": {order: model.top_after(prompt, order, top) for order in ORDERS}}
    if adapter_dir is not None:
        model.load_adapter(adapter_dir)
        found["adapter"] = {order: model.top_after(prompt, order, top) for order in ORDERS}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # servers may start in this process's wake
    return found


def first_token_references(
    model_dir: Path, prompt: list[int], adapter_dir: Path, top: int = 5
) -> dict[str, dict[str, dict[int, float]]]:
    """Every reference a served path is set against, ``{name: {"base" |
    "adapter": {token: logprob}}}``: transformers' Llama in float32
    (:func:`benchmarks.greedy_reference.first_token_logprobs`, the
    independent one) and each of :data:`ORDERS`."""
    from benchmarks.greedy_reference import first_token_logprobs

    references = {"transformers_float32": first_token_logprobs(model_dir, prompt, adapter_dir, top)}
    orders = first_token_orders(model_dir, prompt, adapter_dir, top)
    for order in ORDERS:
        references[order] = {which: tops[order] for which, tops in orders.items()}
    return references


class _Llama:
    """A Llama decoder's forward pass with explicit rounding, from its files."""

    def __init__(self, model_dir: Path, device: str) -> None:
        from safetensors.torch import load_file

        config = json.loads((model_dir / "config.json").read_text())
        rope = config.get("rope_parameters") or {}
        if config.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(f"{model_dir}: only Llama's default rotary embedding")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError(f"{model_dir}: only Llama without biases")
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads", self.heads)
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.layers = config["num_hidden_layers"]
        self.eps = config["rms_norm_eps"]
        self.theta = rope.get("rope_theta") or config.get("rope_theta", 10000.0)
        self.weights: dict[str, Any] = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            self.weights |= load_file(str(shard), device=device)
        if "lm_head.weight" not in self.weights:  # tied embeddings
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.lora: dict[str, tuple[Any, Any, float]] = {}
        self.device = device

    def load_adapter(self, adapter_dir: Path) -> None:
        """The adapter's A and B (as stored, bf16) and its scaling, by layer."""
        from safetensors.torch import load_file

        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        scaling = config["lora_alpha"] / config["r"]
        stored = load_file(str(adapter_dir / "adapter_model.safetensors"), device=self.device)
        for key in [k for k in stored if k.endswith(".lora_A.weight")]:
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            if f"{name}.weight" not in self.weights:
                raise ValueError(f"{adapter_dir}: {name} is not a layer of the model")
            self.lora[name] = (stored[key], stored[key.replace("lora_A", "lora_B")], scaling)

    def top_after(self, prompt: list[int], order: str, top: int) -> dict[int, float]:
        import torch

        from benchmarks.greedy_reference import top_tokens

        with torch.no_grad():
            return top_tokens(self._forward(prompt, order), top)

    def _forward(self, prompt: list[int], order: str) -> Any:
        import torch

        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; choose from {ORDERS}")

        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x if order == "float32" else x.to(torch.bfloat16).float()

        def linear(x: torch.Tensor, name: str) -> torch.Tensor:
            weight = self.weights[f"{name}.weight"]
            if order == "float64_accumulate":
                acc = (x.double() @ weight.double().T).float()
            else:
                acc = x @ weight.float().T
            if name not in self.lora:
                return rounded(acc)
            a, b, scaling = self.lora[name]
            shrunk = rounded(scaling * (x @ a.float().T))  # the shrink's output, read as bf16
            expanded = shrunk @ b.float().T
            if order == "lora_in_accumulator" or order == "float32":
                return rounded(acc + expanded)
            return rounded(rounded(acc) + expanded)

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            scaled = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return rounded(self.weights[f"{name}.weight"].float() * rounded(scaled))

        tokens, d = len(prompt), self.head_dim
        inverse = 1.0 / self.theta ** (
            torch.arange(0, d, 2, device=self.device, dtype=torch.float64) / d
        )
        angles = torch.arange(tokens, device=self.device, dtype=torch.float64)[:, None] * inverse
        cos = torch.cat([angles.cos()] * 2, -1).float()[:, None]
        sin = torch.cat([angles.sin()] * 2, -1).float()[:, None]

        def rotary(x: torch.Tensor) -> torch.Tensor:  # [tokens, heads, d]
            half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
            return rounded(x * cos + half * sin)

        ids = torch.tensor(prompt, device=self.device)
        residual = self.weights["model.embed_tokens.weight"][ids].float()
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=self.device).triu(1)
        for layer in range(self.layers):
            at = f"model.layers.{layer}"
            h = norm(residual, f"{at}.input_layernorm")
            q = rotary(linear(h, f"{at}.self_attn.q_proj").view(tokens, self.heads, d))
            k = rotary(linear(h, f"{at}.self_attn.k_proj").view(tokens, self.kv_heads, d))
            v = linear(h, f"{at}.self_attn.v_proj").view(tokens, self.kv_heads, d)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
            weights = scores.masked_fill(causal, float("-inf")).softmax(-1)
            attended = rounded(torch.einsum("hts,shd->thd", weights, v).reshape(tokens, -1))
            residual = rounded(residual + linear(attended, f"{at}.self_attn.o_proj"))
            h = norm(residual, f"{at}.post_attention_layernorm")
            gate, up = linear(h, f"{at}.mlp.gate_proj"), linear(h, f"{at}.mlp.up_proj")
            mixed = rounded(torch.nn.functional.silu(gate) * up)
            residual = rounded(residual + linear(mixed, f"{at}.mlp.down_proj"))
        last = norm(residual[-1:], "model.norm")
        logits = rounded(last @ self.weights["lm_head.weight"].float().T)[0]
        return torch.log_softmax(logits, -1)
