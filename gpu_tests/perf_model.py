"""Random-weight Llama-shaped models and random LoRA adapters, built on the GPU machine.

Throughput does not care what the weights say, only their shapes; content
checks use the trained embedded adapters instead. Adapters are written from
the config's shapes alone, without loading the model. Sizes (``SIZES``;
``SKYRL_PERF_MODEL`` picks one for the GPU tests and benchmarks): ``0.8b``,
the shape every earlier GPU figure used, and ``8b``, Llama-3-8B's shape
(32 layers, hidden 4096, MLP 14336, 32 query and 8 key-value heads) with the
embedded tokenizer's small vocabulary: 7.0B parameters, 14 GB in bf16.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from benchmarks import vllm_layers
from skyrl_lora.server.embedded import EmbeddedModel
from skyrl_lora.server.embedded.builder import VOCAB_SIZE, build_tokenizer

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


def build_perf_model(root: Path, rank: int = 16, size: str = DEFAULT_SIZE) -> EmbeddedModel:
    """The ``size`` model under ``root`` (built once, deterministically) and its adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown perf model size {size!r}; choose from {sorted(SIZES)}")
    model_dir = root / f"model-{size}" if size != "0.8b" else root / "model"
    if not (model_dir / "config.json").exists():
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            **SIZES[size],
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            dtype="bfloat16",
        )
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(model_dir, safe_serialization=True)
        # The embedded model's tokenizer alone: building the whole embedded
        # model (trained adapters) took minutes of a 10-minute device call.
        build_tokenizer(model_dir)
    adapters = {}
    for i, name in enumerate(ADAPTERS):
        adapters[name] = write_random_adapter(model_dir, root / "adapters" / name, rank, seed=i)
    return EmbeddedModel(root, model_dir, adapters)


def write_random_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    return vllm_layers.write_random_adapter(
        vllm_layers.DecoderShape.of_config(config), out_dir, rank, seed, str(model_dir)
    )
