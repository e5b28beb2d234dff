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

import fcntl
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

if TYPE_CHECKING:  # transformers is imported lazily: importing this module stays cheap
    from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)

#: Bump when anything below changes what gets built; it names the cache folder.
BUILD_VERSION = "v4"
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
#: Message contents joined by spaces (a trailing space would tokenize as <unk>).
CHAT_TEMPLATE = "{% for m in messages %}{{ ' ' if not loop.first }}{{ m['content'] }}{% endfor %}"
TRAIN_STEPS = 80
CHECK_TOKENS = 48


@dataclass(frozen=True)
class EmbeddedModel:
    """Where the built model lives; ``adapters`` maps adapter name to folder."""

    root: Path
    model_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)


def vocabulary() -> list[str]:
    """Token id -> word: specials, animals, filler, then ``<extra_N>`` padding."""
    words = SPECIALS + ANIMALS + [w for w in dict.fromkeys(FILLER) if w not in ANIMALS]
    if len(words) > VOCAB_SIZE:
        raise ValueError(f"{len(words)} words do not fit a vocabulary of {VOCAB_SIZE}")
    return words + [f"<extra_{i}>" for i in range(VOCAB_SIZE - len(words))]


def _word_ids() -> range:
    """Ids of real words (animals and filler): what prompts and babble are made of."""
    return range(len(SPECIALS), vocabulary().index("<extra_0>"))


def build_tokenizer(out_dir: Path) -> None:
    """Write a fast tokenizer that decodes back to space-separated words.

    The config files are written by hand, naming ``PreTrainedTokenizerFast``,
    so that transformers 4 and 5 (and hence any vLLM) load them alike.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = vocabulary()
    plain = set(_word_ids())
    vocab = {("▁" + w if i in plain else w): i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {
        **specials,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", specials)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file`` makes the file private (0600); a shared cache needs it readable."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def _model_config() -> LlamaConfig:
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


def build_base_model(out_dir: Path) -> None:
    """Random weights, made to babble in real words.

    ``lm_head`` is scaled up (x8) so greedy output is confident and varied.
    Its rows for specials and ``<extra_N>`` are zeroed: their logit is then
    always 0, below the best of ~200 random word logits, so the base model
    never says EOS, ``<pad>`` or padding. Animal rows get x6: enough for the
    adapters to reach a near-certain word (loss ~5e-4), small enough that
    the base model does not copy a run of animal words it is shown.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(_model_config())
    with torch.no_grad():
        scale = torch.zeros(VOCAB_SIZE, 1)
        scale[list(_word_ids())] = 8.0
        scale[len(SPECIALS) : len(SPECIALS) + len(ANIMALS)] = 6.0
        model.lm_head.weight.mul_(scale)
    # What save_pretrained writes, minus its progress bar on stderr.
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    _save_tensors(model.state_dict(), out_dir / "model.safetensors")
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out_dir)


def load_model(model_dir: Path, adapter_dir: Path | None = None) -> LlamaForCausalLM:
    """The float32 base model, with a saved adapter applied when given.

    Loads the state dict directly (no ``from_pretrained``): quicker and quiet.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
    if adapter_dir is not None:
        apply_adapter(model, adapter_dir)
    return model.eval().requires_grad_(False)


def apply_adapter(model: nn.Module, adapter_dir: Path) -> int:
    """Wrap ``model``'s target layers with a saved PEFT adapter's LoRA, its
    weights cast to the layer's dtype; how many layers took one. The adapter
    must cover exactly those layers (ours do): a mismatch is refused, not
    skipped, so a reference built from it cannot quietly lack a layer."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    wrapped = _wrap_lora(model, config["r"], config["lora_alpha"])
    names = {key.rsplit(".lora_", 1)[0].removeprefix("base_model.model.") for key in weights}
    if names != wrapped.keys():
        odd = sorted(names ^ wrapped.keys())[:3]
        raise ValueError(f"{adapter_dir} does not cover the model's LoRA layers: {odd}")
    for name, lora in wrapped.items():
        dtype = lora.base.weight.dtype
        lora.lora_A.data = weights[f"base_model.model.{name}.lora_A.weight"].to(dtype)
        lora.lora_B.data = weights[f"base_model.model.{name}.lora_B.weight"].to(dtype)
    return len(wrapped)


class LoRALinear(nn.Module):
    """``W x + (alpha / r) * B A x``: the same math as PEFT and vLLM."""

    def __init__(self, base: nn.Linear, rank: int, alpha: int) -> None:
        super().__init__()
        self.base = base
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def _wrap_lora(model: nn.Module, rank: int, alpha: int) -> dict[str, LoRALinear]:
    """Replace every target ``nn.Linear`` in place; keys are PEFT module names."""
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
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random contexts (filler and animal words alike), label always ``word_id``.

    Half the rows end in a run of one animal word, as the context looks after
    another adapter has been sampling and this one takes over mid-sample.
    """
    words = _word_ids()
    animals = len(SPECIALS) + torch.randint(0, len(ANIMALS), (steps, batch), generator=generator)
    for step in range(steps):
        length = int(torch.randint(4, 65, (1,), generator=generator))
        inputs = torch.randint(words.start, words.stop, (batch, length), generator=generator)
        inputs[: batch // 2, length // 2 :] = animals[step, : batch // 2, None]
        yield inputs, torch.full_like(inputs, word_id)


def build_adapter(
    model_dir: Path,
    out_dir: Path,
    word: str,
    rank: int = 8,
    seed: int = SEED,
    steps: int = TRAIN_STEPS,
    alpha: int | None = None,
) -> Path:
    """Train a LoRA adapter (alpha ``2 * rank`` by default) that makes the model
    repeat ``word`` whatever the context; save it in PEFT format."""
    word_id = vocabulary().index(word)
    torch.manual_seed(seed + word_id)
    model = load_model(model_dir)
    alpha = alpha or 2 * rank
    wrapped = _wrap_lora(model, rank, alpha)
    params = [p for lora in wrapped.values() for p in (lora.lora_A, lora.lora_B)]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    generator = torch.Generator().manual_seed(seed + word_id)
    loss = torch.tensor(float("nan"))
    for inputs, labels in _batches(word_id, steps, batch=16, generator=generator):
        logits = model(input_ids=inputs).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    logger.info("adapter %s (rank %d): final loss %.5f", word, rank, loss.item())
    return _save_adapter(model_dir, out_dir, wrapped, rank, alpha)


def build_babble_adapter(model_dir: Path, out_dir: Path, rank: int = 8, seed: int = SEED) -> Path:
    """An untrained adapter with random weights: varied, unpredictable output.

    Word adapters repeat one token, which makes token-for-token comparisons
    too easy; this one gives the greedy-equivalence tests something to lose.
    """
    torch.manual_seed(seed)
    wrapped = _wrap_lora(load_model(model_dir), rank, 2 * rank)
    for lora in wrapped.values():
        nn.init.normal_(lora.lora_B, std=0.05)
    return _save_adapter(model_dir, out_dir, wrapped, rank, 2 * rank)


def _save_adapter(
    model_dir: Path, out_dir: Path, wrapped: dict[str, LoRALinear], rank: int, alpha: int
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT does."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, lora in wrapped.items():
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = lora.lora_A.detach().contiguous()
        tensors[f"{key}.lora_B.weight"] = lora.lora_B.detach().contiguous()
    _save_tensors(tensors, out_dir / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    _write_json(out_dir / "adapter_config.json", config)
    return out_dir


def greedy_words(model: nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation with plain torch (no EOS stop), to check what was built."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return [int(t) for t in ids[0, len(prompt) :]]


def _check_prompts() -> list[list[int]]:
    """The tests' prompt, one word, random salad, then runs of each adapter's word."""
    words, ids = vocabulary(), _word_ids()
    generator = torch.Generator().manual_seed(SEED)
    salad = torch.randint(ids.start, ids.stop, (40,), generator=generator).tolist()
    tests_prompt = [words.index(w) for w in ("hello", "there", "how", "are", "you")]
    runs = [[words.index(w)] * 12 for w in ADAPTER_WORDS]
    return [tests_prompt, [words.index("hi")], salad, *runs]


def _check(model_dir: Path, adapters: dict[str, Path]) -> None:
    """Fail the build unless the tokenizer round-trips, each word adapter
    repeats its word after any prompt, babble varies and the base model
    mostly says other words than animals."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.decode(tokenizer.encode("meow meow meow")) != "meow meow meow":
        raise RuntimeError("the tokenizer does not round-trip 'meow meow meow'")
    words, prompts = vocabulary(), _check_prompts()
    for name in ADAPTER_WORDS:
        model = load_model(model_dir, adapters[name])
        for prompt in prompts:
            out = greedy_words(model, prompt, CHECK_TOKENS)
            if set(out) != {words.index(name)}:
                raise RuntimeError(f"adapter {name} says {' '.join(words[t] for t in out)}")
    # Random weights settle into a loop sooner or later: look far enough ahead.
    babble = greedy_words(load_model(model_dir, adapters[BABBLE]), prompts[0], 3 * CHECK_TOKENS)
    if len(set(babble)) <= 3:
        raise RuntimeError(f"adapter {BABBLE} says only {' '.join(words[t] for t in set(babble))}")
    base = load_model(model_dir)
    for prompt in prompts:
        out = greedy_words(base, prompt, CHECK_TOKENS)
        if sum(words[t] in ANIMALS for t in out) > len(out) // 2:
            raise RuntimeError(f"the base model barks: {' '.join(words[t] for t in out)}")


def build(out_dir: Path) -> EmbeddedModel:
    """Build and check everything in ``out_dir``."""
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        model_dir = out_dir / "model"
        build_tokenizer(model_dir)
        build_base_model(model_dir)
        adapter_dir = out_dir / "adapters"
        adapters = {w: build_adapter(model_dir, adapter_dir / w, w) for w in ADAPTER_WORDS}
        adapters[BABBLE] = build_babble_adapter(model_dir, adapter_dir / BABBLE)
        _check(model_dir, adapters)
    finally:
        torch.set_num_threads(threads)
    logger.info("embedded model built in %.1f s", time.monotonic() - started)
    return EmbeddedModel(out_dir, model_dir, adapters)


def _point_adapters_at(root: Path, model_dir: Path) -> None:
    """Name the final model folder as each adapter's base (not the scratch one)."""
    for config_path in (root / "adapters").glob("*/adapter_config.json"):
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = str(model_dir)
        _write_json(config_path, config)


def default_cache_dir() -> Path:
    """``$SKYRL_LORA_CACHE/embedded/<version>``, else under ``~/.cache/skyrl_lora``."""
    root = os.environ.get("SKYRL_LORA_CACHE") or Path.home() / ".cache" / "skyrl_lora"
    return Path(root) / "embedded" / BUILD_VERSION


def _describe(root: Path) -> EmbeddedModel:
    names = (*ADAPTER_WORDS, BABBLE)
    return EmbeddedModel(root, root / "model", {n: root / "adapters" / n for n in names})


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` (released by the kernel if the holder dies).

    Builders wait for each other rather than build side by side: two
    builds on two cores, each with two torch threads, run ~25x slower.
    """
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_into(target: Path) -> None:
    """Build in a scratch sibling, then rename it into place in one step, so
    a crash never leaves a half-built ``target``. Should the rename find the
    target completed by another builder (no working lock, e.g. on some
    network file systems), that counts as success."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        build(scratch / "out")
        _point_adapters_at(scratch / "out", target.absolute() / "model")
        (scratch / "out" / "COMPLETE").write_text(BUILD_VERSION + "\n")
        try:
            os.replace(scratch / "out", target)
        except OSError as error:
            if not (target / "COMPLETE").exists():
                raise RuntimeError(f"{target} exists but holds no complete build") from error
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ensure_embedded_model(cache_dir: Path | None = None) -> EmbeddedModel:
    """Return the build in ``cache_dir`` (default: ``default_cache_dir()``),
    building it first if it is not complete; safe with concurrent callers."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not (target / "COMPLETE").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(target.parent / f".{target.name}.lock"):
            if not (target / "COMPLETE").exists():
                _build_into(target)
    return _describe(target)
