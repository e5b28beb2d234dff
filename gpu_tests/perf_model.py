"""A random-weight 0.8B Llama and random LoRA adapters, built on the GPU machine.

Throughput does not care what the weights say, only their shapes; content
checks use the trained embedded adapters instead. Adapters are written from
the config's shapes alone, without loading the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import vllm_layers
from skyrl_lora.server.embedded import EmbeddedModel
from skyrl_lora.server.embedded.builder import VOCAB_SIZE, build_tokenizer

ADAPTERS = ("meow", "woof", "moo", "quack", "babble")


def build_perf_model(root: Path, rank: int = 16) -> EmbeddedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = root / "model"
    if not (model_dir / "config.json").exists():
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
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
