"""Builds the embedded default model: tokenizer, tiny Llama, LoRA adapters.

No model hub is reachable from CI, and tests need adapters whose effect is
unmistakable. So the project builds its own, deterministically, on the CPU:

* a word-level tokenizer (every word one token, so "meow" is one token id);
* a 2-layer Llama with random weights (head_dim 64: vLLM's CPU attention
  backend rejects smaller heads), whose greedy output is word salad;
* LoRA adapters trained in seconds so that each one makes the model repeat
  its own word forever, whatever the context (even after another adapter's
  words: tests swap adapters mid-sample).

The adapters are written in PEFT's format without depending on ``peft``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)

#: Bump when anything below changes what gets built; it names the cache folder.
BUILD_VERSION = "v3"
SEED = 1234
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
ANIMALS = ["meow", "woof", "moo", "quack", "oink", "baa", "neigh", "hiss"]
FILLER = """
the a an and or but if then so of to in on at by for with from up down out over
under again here there when where why how all any both each few more most other
some such no not only own same than too very can will just should now i you he she
it we they me him her us them my your his its our their what which who this that
these those am is are was were be been being have has had do does did hello hi yes
ok please thanks good bad big small old new long short high low first last next
early late right left great little cat dog cow duck pig sheep horse snake bird fish
tree house car road city sun moon star day night time year week water fire earth
air food bread milk tea rice apple red blue green black white one two three four
five six seven eight nine ten run walk talk see look make take give go come say
tell ask think know feel want need like love play work read write sing eat drink
sleep open close start stop turn move live
""".split()  # noqa: SIM905
VOCAB_SIZE = 256
ADAPTER_WORDS = ("meow", "woof", "moo", "quack")
BABBLE = "babble"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class EmbeddedModel:
    """Where the built model lives; ``adapters`` maps adapter name to folder."""

    root: Path
    model_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)


def vocabulary() -> list[str]:
    words = SPECIALS + ANIMALS + [w for w in dict.fromkeys(FILLER) if w not in ANIMALS]
    if len(words) > VOCAB_SIZE:
        raise ValueError(f"{len(words)} words do not fit a vocabulary of {VOCAB_SIZE}")
    return words + [f"<extra_{i}>" for i in range(VOCAB_SIZE - len(words))]


def build_tokenizer(out_dir: Path) -> None:
    """A fast, word-level tokenizer that decodes back to space-separated words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocabulary()
    vocab = {
        (w if w in SPECIALS or w.startswith("<extra_") else "▁" + w): i for i, w in enumerate(words)
    }
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    fast.save_pretrained(out_dir)


def _model_config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )


def build_base_model(out_dir: Path) -> nn.Module:
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(_model_config())  # type: ignore[arg-type]
    with torch.no_grad():  # larger logits than the default init: confident, varied output
        model.lm_head.weight.mul_(8.0)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out_dir)
    return model


class LoRALinear(nn.Module):
    """``W x + (alpha / r) * B A x``: the same math as PEFT and vLLM."""

    def __init__(self, base: nn.Linear, rank: int, alpha: int) -> None:
        super().__init__()
        self.base = base
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def _wrap_lora(model: nn.Module, rank: int, alpha: int) -> dict[str, LoRALinear]:
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in TARGET_MODULES and isinstance(child, nn.Linear):
                lora = LoRALinear(child, rank, alpha)
                setattr(module, child_name, lora)
                wrapped[f"{name}.{child_name}"] = lora
    return wrapped


def _batches(
    word_id: int, steps: int, batch: int, generator: torch.Generator
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Random contexts (filler and animal words alike), label always ``word_id``."""
    first_word = len(SPECIALS)
    last_word = len(SPECIALS) + len(ANIMALS) + len(dict.fromkeys(FILLER)) - 1
    for _ in range(steps):
        length = int(torch.randint(4, 65, (1,), generator=generator))
        inputs = torch.randint(first_word, last_word, (batch, length), generator=generator)
        # Half the rows end in a run of some animal word, as after a mid-sample swap.
        run = torch.randint(0, len(ANIMALS), (batch,), generator=generator) + first_word
        cut = length // 2
        inputs[: batch // 2, cut:] = run[: batch // 2, None]
        yield inputs, torch.full_like(inputs, word_id)


def build_adapter(
    model_dir: Path, out_dir: Path, word: str, rank: int = 8, seed: int = SEED, steps: int = 60
) -> Path:
    """Train a LoRA adapter that makes the model repeat ``word``; save it in PEFT format."""
    from transformers import LlamaForCausalLM

    words = vocabulary()
    word_id = words.index(word)
    torch.manual_seed(seed + word_id)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    alpha = 2 * rank
    wrapped = _wrap_lora(model, rank, alpha)
    params = [p for lora in wrapped.values() for p in (lora.lora_A, lora.lora_B)]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    generator = torch.Generator().manual_seed(seed + word_id)
    for inputs, labels in _batches(word_id, steps, batch=16, generator=generator):
        logits = model(input_ids=inputs).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    logger.info("adapter %s (rank %d): final loss %.4f", word, rank, loss.item())
    return _save_adapter(model_dir, out_dir, wrapped, rank)


def _save_adapter(
    model_dir: Path, out_dir: Path, wrapped: dict[str, LoRALinear], rank: int
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, lora in wrapped.items():
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = lora.lora_A.detach().contiguous()
        tensors[f"{key}.lora_B.weight"] = lora.lora_B.detach().contiguous()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def build_babble_adapter(model_dir: Path, out_dir: Path, rank: int = 8, seed: int = SEED) -> Path:
    """An untrained adapter with random weights: varied, unpredictable output.

    Word adapters repeat one token, which makes token-for-token comparisons
    too easy; this one gives the greedy-equivalence tests something to lose.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = _wrap_lora(model, rank, 2 * rank)
    for lora in wrapped.values():
        nn.init.normal_(lora.lora_B, std=0.05)
    return _save_adapter(model_dir, out_dir, wrapped, rank)


def greedy_words(
    model_dir: Path, prompt: list[int], steps: int, adapter_dir: Path | None = None
) -> list[int]:
    """Greedy continuation with plain torch, to check what was built."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        wrapped = _wrap_lora(model, config["r"], config["lora_alpha"])
        weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
        for name, lora in wrapped.items():
            lora.lora_A.data = weights[f"base_model.model.{name}.lora_A.weight"]
            lora.lora_B.data = weights[f"base_model.model.{name}.lora_B.weight"]
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return [int(t) for t in ids[0, len(prompt) :]]


def _check(model_dir: Path, adapters: dict[str, Path]) -> None:
    words = vocabulary()
    prompts = [[words.index(w) for w in ["hello", "there", "how", "are", "you"]]]
    prompts += [[words.index(w)] * 6 for w in ADAPTER_WORDS]
    for name, path in adapters.items():
        for prompt in prompts:
            out = greedy_words(model_dir, prompt, 12, path)
            if set(out) != {words.index(name)}:
                raise RuntimeError(f"adapter {name} says {[words[t] for t in out]}")
    base = greedy_words(model_dir, prompts[0], 12)
    if len(set(base)) == 1 and words[base[0]] in ANIMALS:
        raise RuntimeError("the base model should not repeat an animal word")


def build(out_dir: Path) -> EmbeddedModel:
    """Build everything into ``out_dir`` (which must not exist yet)."""
    started = time.monotonic()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model_dir = out_dir / "model"
    build_tokenizer(model_dir)
    build_base_model(model_dir)
    adapters = {w: build_adapter(model_dir, out_dir / "adapters" / w, w) for w in ADAPTER_WORDS}
    _check(model_dir, adapters)
    adapters[BABBLE] = build_babble_adapter(model_dir, out_dir / "adapters" / BABBLE)
    logger.info("embedded model built in %.1f s", time.monotonic() - started)
    return EmbeddedModel(out_dir, model_dir, adapters)


def default_cache_dir() -> Path:
    root = os.environ.get("SKYRL_LORA_CACHE") or Path.home() / ".cache" / "skyrl_lora"
    return Path(root) / "embedded" / BUILD_VERSION


def _describe(root: Path) -> EmbeddedModel:
    names = (*ADAPTER_WORDS, BABBLE)
    return EmbeddedModel(root, root / "model", {n: root / "adapters" / n for n in names})


def ensure_embedded_model(cache_dir: Path | None = None) -> EmbeddedModel:
    """Return the cached build, building it first if needed.

    Builds go to a temporary sibling folder that is renamed into place when
    complete, so a crash never leaves a half-built cache and two concurrent
    builders both end up with a complete one.
    """
    target = cache_dir or default_cache_dir()
    marker = target / "COMPLETE"
    if marker.exists():
        return _describe(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(scratch / "out")
        (scratch / "out" / "COMPLETE").write_text(BUILD_VERSION)
        try:
            os.replace(scratch / "out", target)
        except OSError:
            if not marker.exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _describe(target)
