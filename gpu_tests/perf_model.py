"""A random-weight 0.8B Llama and random LoRA adapters, built on the GPU machine.

Throughput does not care what the weights say, only their shapes; content
checks use the trained embedded adapters instead. Adapters are written from
the config's shapes alone, without loading the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from skyrl_lora.server.embedded import EmbeddedModel
from skyrl_lora.server.embedded.builder import TARGET_MODULES, VOCAB_SIZE, build_tokenizer

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
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
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
    for layer in range(config["num_hidden_layers"]):
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
                "base_model_name_or_path": str(model_dir),
            }
        )
    )
    return out_dir
