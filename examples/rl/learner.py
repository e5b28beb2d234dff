"""One tenant's trainer: a fresh PEFT LoRA, GRPO updates on the CPU or a GPU.

On the CPU it trains the embedded model in float32; on a GPU (``device``
``cuda``) any Llama-shaped model folder in bfloat16 with float32 LoRA
weights, recomputing activations in the backward pass
(``checkpointing``) so that several trainers share the GPU with vLLM.
The adapter matches what the server accepts (the builder's target modules),
so what :meth:`Learner.save` writes loads straight into vLLM. A fresh LoRA
has ``B = 0``: version 0 of every tenant is the base model.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from skyrl_lora.client import AdapterHandover, RemoteInferenceClient
from skyrl_lora.rl_accounting import (
    OffPolicyConfig,
    TokenWeights,
    group_advantages,
    token_staleness,
    token_weights,
)
from skyrl_lora.server.embedded.builder import TARGET_MODULES, load_model
from skyrl_lora.types import SampledSequence, SwapPolicy


@dataclass(frozen=True)
class LearnerConfig:
    rank: int = 8
    alpha: int = 16
    lr: float = 7e-3
    seed: int = 0
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    device: str = "cpu"
    #: the base weights' dtype (LoRA weights stay float32; saved adapters take this dtype)
    dtype: str = "float32"
    #: recompute each layer's activations in the backward pass (GPU memory)
    checkpointing: bool = False


@dataclass(frozen=True)
class HandOver:
    """A hand-over's version, and where the learner process spent its time:
    what a sync's push costs beyond these is the trip to the process and back."""

    version: int
    state_s: float  # the adapter's weights (looked up once, then the same views)
    update_s: float  # queueing the copy into the hand-over buffer (cast to the base dtype)
    request_s: float  # the HTTP call: the server's copy out, staging and answer


@dataclass(frozen=True)
class Group:
    """The samples of one prompt (GRPO normalises rewards within it)."""

    prompt: tuple[int, ...]
    sequences: tuple[SampledSequence, ...]


@dataclass(frozen=True)
class StepResult:
    """What one update saw: rewards, and the accounting of every token."""

    rewards: tuple[float, ...]
    tokens: tuple[TokenWeights, ...]
    loss: float
    train_s: float = 0.0  # forward, backward and optimizer, inside the learner

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)


class Learner:
    """Holds the LoRA weights and the optimizer of one tenant."""

    def __init__(self, model_dir: Path, targets: frozenset[int], config: LearnerConfig) -> None:
        self.targets = targets
        self.config = config
        self.device = torch.device(config.device)
        lora = LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            target_modules=list(TARGET_MODULES),
            lora_dropout=0.0,
        )
        base = _base_model(model_dir, config)
        torch.manual_seed(config.seed)  # the LoRA A init: same seed, same start
        self.model = get_peft_model(base, lora)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.initial = {n: p.detach().clone() for n, p in self.params.items()}
        self._weights: dict[str, torch.Tensor] | None = None
        self.optimizer = torch.optim.Adam(self.params.values(), lr=config.lr)

    def reset(self) -> None:
        """Back to the fresh LoRA and a fresh optimizer: the next mode starts
        where the first did, without a new process and model load."""
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.initial[name])
        self.optimizer = torch.optim.Adam(self.params.values(), lr=self.config.lr)

    def warm_up(self, tokens: int = 512, rows: int = 8) -> None:
        """One forward and backward pass of the largest batch shape, then
        :meth:`reset`: the first timed step pays no kernel selection."""
        if self.device.type == "cpu":
            return
        ids = torch.randint(0, 8, (rows, tokens), device=self.device)
        self.model.train()
        self.model(input_ids=ids).logits.float().mean().backward()
        self.optimizer.zero_grad()
        torch.cuda.synchronize(self.device)
        self.reset()

    def reward(self, seq: SampledSequence) -> float:
        """Share of generated words that are target words."""
        return sum(t in self.targets for t in seq.tokens) / max(len(seq.tokens), 1)

    def token_logprobs(
        self, prompt: Sequence[int], seqs: Sequence[SampledSequence]
    ) -> torch.Tensor:
        """Logprob of every generated token under the current weights, ``[n, T]``
        (padded with 0 past each sequence's end). Sampling is at temperature 1,
        so this is comparable with the server's raw logprobs."""
        width = max(len(s.tokens) for s in seqs)
        ids = torch.zeros(len(seqs), len(prompt) + width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(prompt) + len(s.tokens)] = torch.tensor([*prompt, *s.tokens])
        ids = ids.to(self.device)
        logits = self.model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float()
        targets = ids[:, len(prompt) :]
        lp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        mask = torch.zeros_like(lp, dtype=torch.bool)
        for i, s in enumerate(seqs):
            mask[i, : len(s.tokens)] = True
        return lp * mask

    def step(self, groups: Sequence[Group], trainer_version: int) -> StepResult:
        """One GRPO update: loss = -sum(advantage * clipped ratio * logprob) / kept tokens.

        The ratio is a constant weight (truncated importance sampling), so the
        gradient is the off-policy-corrected policy gradient. The backward
        pass runs group by group (the gradients add up), so one group's
        activations are alive at a time; the kept-token count it divides by
        depends on versions alone, so it is known before the first forward.
        """
        started = time.monotonic()
        self.model.train()
        max_staleness = self.config.off_policy.max_staleness
        kept = sum(
            s <= max_staleness
            for group in groups
            for seq in group.sequences
            for s in token_staleness(seq, trainer_version)
        )
        kept = max(kept, 1)
        rewards: list[float] = []
        accounts: list[TokenWeights] = []
        total = 0.0
        self.optimizer.zero_grad()
        for group in groups:
            group_rewards = [self.reward(s) for s in group.sequences]
            advantages = group_advantages(group_rewards)
            logprobs = self.token_logprobs(group.prompt, group.sequences)
            rows = logprobs.detach().cpu().tolist()
            terms: list[torch.Tensor] = []
            for i, (seq, adv) in enumerate(zip(group.sequences, advantages)):
                row = rows[i][: len(seq.tokens)]
                account = token_weights(seq, row, trainer_version, self.config.off_policy)
                weights = torch.tensor(account.weights, device=self.device)
                terms.append((adv * weights * logprobs[i, : len(seq.tokens)]).sum())
                accounts.append(account)
            loss = -torch.stack(terms).sum() / kept
            loss.backward()
            total += float(loss.detach())
            rewards.extend(group_rewards)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(
            tuple(rewards), tuple(accounts), total, train_s=time.monotonic() - started
        )

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA weights in PEFT's naming, in the training dtype: views
        of the parameters (the optimizer and :meth:`reset` write them in
        place), so they are looked up once. A hand-over casts them in its
        copy into the buffer (:class:`AdapterHandover`'s ``dtype``)."""
        if self._weights is None:
            from peft import get_peft_model_state_dict

            self._weights = {
                k: v.detach() for k, v in get_peft_model_state_dict(self.model).items()
            }
        return self._weights

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights in PEFT's naming, cast to the base dtype (a
        bfloat16 adapter is half the bytes to move), on the learner's device."""
        from peft import get_peft_model_state_dict

        dtype = getattr(torch, self.config.dtype)
        return {
            k: v.detach().to(dtype).contiguous()
            for k, v in get_peft_model_state_dict(self.model).items()
        }

    def adapter_config(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json``, as a mapping."""
        config = self.model.peft_config["default"].to_dict()
        return dict(json.loads(json.dumps(config, default=_jsonable)))

    def save(self, folder: Path) -> Path:
        """What PEFT's ``save_pretrained`` writes (adapter_config.json +
        adapter_model.safetensors)."""
        from safetensors.torch import save_file

        state = {k: v.cpu() for k, v in self.adapter_state().items()}
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.model.peft_config["default"].save_pretrained(str(folder))
        return folder


def _jsonable(value: object) -> object:
    """PEFT's config holds sets (target modules) and enums."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def _base_model(model_dir: Path, config: LearnerConfig) -> torch.nn.Module:
    """The frozen base: the embedded loader on the CPU, ``from_pretrained`` elsewhere."""
    if config.device == "cpu" and config.dtype == "float32":
        base = load_model(model_dir)
    else:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, config.dtype)
        ).to(config.device)  # type: ignore[arg-type]
    base.requires_grad_(False)
    if config.checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return base


# -- the learner in its own process -------------------------------------------
# A step is mostly small torch calls from Python: run in a thread of the
# sampling process it holds the GIL, and the samplers' event loop (which
# sends requests and reads answers) stalls for the whole step. In a process
# of its own it shares nothing with the samplers but the CPU.

_LEARNER: Learner | None = None


@dataclass
class _Sender:
    """The learner process's hand-over buffer, event loop and client, made at
    its first hand-over and kept: a sync pays for neither a new loop nor a
    new connection."""

    handover: AdapterHandover
    loop: asyncio.AbstractEventLoop
    client: RemoteInferenceClient
    api_key: str | None = None


_SENDER: _Sender | None = None


def _start(model_dir: Path, targets: frozenset[int], config: LearnerConfig) -> None:
    global _LEARNER
    torch.set_num_threads(1)  # several trainers and the server share a few cores
    _LEARNER = Learner(model_dir, targets, config)
    _LEARNER.warm_up()


def _learner() -> Learner:
    if _LEARNER is None:
        raise RuntimeError("the learner process was not started")
    return _LEARNER


def _ready() -> None:
    _learner()


def _step(groups: Sequence[Group], trainer_version: int) -> StepResult:
    return _learner().step(groups, trainer_version)


def _save(folder: Path) -> Path:
    return _learner().save(folder)


def _hand_over(
    url: str, lora_name: str, version: int, policy: SwapPolicy, api_key: str | None
) -> HandOver:
    """Hand the adapter to the server by handle from this process, where the
    tensors live: only a small JSON body leaves it (CUDA IPC on a GPU)."""
    global _SENDER
    learner = _learner()
    if _SENDER is None or (_SENDER.client.urls, _SENDER.api_key) != ([url], api_key):
        loop = asyncio.new_event_loop()
        client = RemoteInferenceClient(url, api_key=api_key)
        handover = AdapterHandover(learner.adapter_config(), dtype=learner.config.dtype)
        _SENDER = _Sender(handover, loop, client, api_key)
    started = time.monotonic()
    state = learner.adapter_weights()
    stated = time.monotonic()
    _SENDER.handover.update(state)
    updated = time.monotonic()
    loaded = _SENDER.loop.run_until_complete(
        _SENDER.client.push_lora_adapter(
            lora_name, _SENDER.handover, swap_policy=policy, version=version
        )
    )
    return HandOver(loaded.version, stated - started, updated - stated, time.monotonic() - updated)


def _reset() -> None:
    _learner().reset()


class LearnerProcess:
    """A :class:`Learner` in a worker process of its own, driven with ``await``."""

    def __init__(self, model_dir: Path, targets: frozenset[int], config: LearnerConfig) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start,
            initargs=(model_dir, targets, config),
        )

    async def ready(self) -> None:
        """Wait until the process has started and built its model (seconds:
        it imports torch and PEFT), so that a run's clock does not count it."""
        await asyncio.get_running_loop().run_in_executor(self._pool, _ready)

    async def step(self, groups: Sequence[Group], trainer_version: int) -> StepResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _step, groups, trainer_version)

    async def save(self, folder: Path) -> Path:
        return await asyncio.get_running_loop().run_in_executor(self._pool, _save, folder)

    async def hand_over(
        self,
        url: str,
        lora_name: str,
        version: int,
        policy: SwapPolicy = "abort_resume",
        api_key: str | None = None,
    ) -> HandOver:
        """Load the learner's weights as ``lora_name``'s ``version`` on the server
        at ``url`` (same host) by hand-over, no file or bytes; returns the
        version and the learner process's times."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, _hand_over, url, lora_name, version, policy, api_key
        )

    async def reset(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, _reset)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    def __enter__(self) -> LearnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
