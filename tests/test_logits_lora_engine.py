"""An adapter's ``lm_head`` LoRA still reaches its logits, and only its own.

vLLM runs LoRA on the logits for every adapter's rows, ``lm_head`` weights
or not; the engine now skips it while no slot holds such weights
(:func:`skyrl_lora.server.compat.skip_logits_lora_while_unweighted`). On the
embedded model's CPU engine: an adapter with ``lm_head`` weights (the
``meow`` adapter plus a random ``lm_head`` term large enough to move every
greedy token) samples otherwise than ``meow`` alone, while ``meow`` served
beside it samples as it did before it came and after it went.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import EngineServer
from tests.test_push_engine import admin, sample

pytestmark = pytest.mark.engine

__all__ = ["admin"]

LM_HEAD = "base_model.model.lm_head"


def with_lm_head(server: EngineServer, word: str, name: str) -> Path:
    """A copy of the ``word`` adapter with random ``lm_head`` LoRA weights."""
    assert server.adapter_root is not None
    folder = server.adapter_root / name
    shutil.copytree(server.model.adapters[word], folder, dirs_exist_ok=True)
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    hidden = next(t.size(1) for k, t in tensors.items() if "q_proj.lora_A" in k)
    model_config = json.loads((Path(server.model.model_dir) / "config.json").read_text())
    gen = torch.Generator().manual_seed(11)
    rank = int(config["r"])
    tensors[f"{LM_HEAD}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen)
    tensors[f"{LM_HEAD}.lora_B.weight"] = 4 * torch.randn(
        model_config["vocab_size"], rank, generator=gen
    )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config["target_modules"] = [*config["target_modules"], "lm_head"]
    config_file.write_text(json.dumps(config))
    return folder


async def test_lm_head_lora_applies_to_its_own_rows_only(engine_server, admin) -> None:
    await admin.load_lora_adapter("logits-meow", str(engine_server.model.adapters["meow"]))
    alone = (await sample(admin, engine_server, "logits-meow", 12)).sequences[0].tokens

    await admin.load_lora_adapter("logits-head", str(with_lm_head(engine_server, "meow", "head")))
    head = (await sample(admin, engine_server, "logits-head", 12)).sequences[0].tokens
    beside = (await sample(admin, engine_server, "logits-meow", 12)).sequences[0].tokens
    assert head != alone, "the lm_head weights did not reach the logits"
    assert beside == alone, "another adapter's lm_head weights reached meow's logits"

    await admin.unload_lora_adapter("logits-head")
    after = (await sample(admin, engine_server, "logits-meow", 12)).sequences[0].tokens
    assert after == alone
    await admin.unload_lora_adapter("logits-meow")
