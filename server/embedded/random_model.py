"""Random-weight Llama-shaped models and random LoRA adapters, built from a config.

Throughput does not care what the weights say, only their shapes: the GPU
tests, the benchmarks and the RL example's GPU mode measure on these, while
content checks use the trained embedded adapters. Nothing is downloaded;
the same seed builds the same weights. Sizes (``SIZES``; ``SKYRL_PERF_MODEL``
picks the default): ``0.8b``, the shape of every earlier GPU figure, and
``8b``, Llama-3-8B's shape (32 layers, hidden 4096, MLP 14336, 32 query and
8 key-value heads) with the embedded tokenizer's small vocabulary: 7.0B
parameters, 14 GB in bf16, and 336 MB for a rank-64 adapter on every linear
layer. Adapters are written from the config's shapes alone, without loading
the model. Needs torch and transformers (the server extras).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .builder import TARGET_MODULES, VOCAB_SIZE, EmbeddedModel, build_tokenizer

ADAPTERS = ("meow", "woof", "moo", "quack", "babble")

#: Decoder shapes by name: the config fields that differ between sizes.
SIZES: dict[str, dict[str, int]] = {
    "0.8b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}
DEFAULT_SIZE = os.environ.get("SKYRL_PERF_MODEL", "0.8b")


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's LoRA-relevant sizes; the default is the GPU perf model's."""

    hidden: int = 2048
    intermediate: int = 5632
    heads: int = 16
    kv_heads: int = 16
    layers: int = 16

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> DecoderShape:
        """The shape of a Hugging Face Llama ``config.json``."""
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            layers=config["num_hidden_layers"],
        )


def write_random_adapter(
    shape: DecoderShape, out_dir: Path, rank: int, seed: int, base_model: str
) -> Path:
    """A PEFT adapter of ``shape`` with random bf16 weights (every projection, rank ``rank``).

    Throughput does not care what the weights say, only their shapes.
    """
    import torch
    from safetensors.torch import save_file

    hidden, inter = shape.hidden, shape.intermediate
    kv = shape.kv_heads * (hidden // shape.heads)
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()},
        str(out_dir / "adapter_model.safetensors"),
    )
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(TARGET_MODULES),
                "base_model_name_or_path": base_model,
            }
        )
    )
    return out_dir


def build_random_model(root: Path, rank: int = 16, size: str = DEFAULT_SIZE) -> EmbeddedModel:
    """The ``size`` model under ``root`` (built once, deterministically) and its adapters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown perf model size {size!r}; choose from {sorted(SIZES)}")
    model_dir = root / f"model-{size}" if size != "0.8b" else root / "model"
    if not (model_dir / "config.json").exists():
        shape: dict[str, Any] = dict(SIZES[size])
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            **shape,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            dtype="bfloat16",
        )
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model: Any = LlamaForCausalLM(config)
            model = model.to(torch.bfloat16)
        model.save_pretrained(model_dir, safe_serialization=True)
        # Built on the GPU, the model's memory stays in torch's cache after it
        # is gone: 27 GB for the 8B shape, which the servers a benchmark then
        # starts from this process no longer found free (H100, 2026-11-27).
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        # The embedded model's tokenizer alone: building the whole embedded
        # model (trained adapters) took minutes of a 10-minute device call.
        build_tokenizer(model_dir)
    adapters = {}
    for i, name in enumerate(ADAPTERS):
        adapters[name] = write_model_adapter(model_dir, root / "adapters" / name, rank, seed=i)
    return EmbeddedModel(root, model_dir, adapters)


def write_model_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int) -> Path:
    """A random adapter of ``rank`` for the model in ``model_dir`` (from its config)."""
    config = json.loads((model_dir / "config.json").read_text())
    return write_random_adapter(DecoderShape.of_config(config), out_dir, rank, seed, str(model_dir))
