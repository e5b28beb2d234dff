"""One tenant's trainer: a fresh PEFT LoRA on the embedded model, GRPO updates on CPU.

The adapter matches what the server accepts for the embedded model (rank
<= 64, the builder's target modules), so ``save_pretrained`` output loads
straight into vLLM. A fresh LoRA has ``B = 0``: version 0 of every tenant is
the base model, which almost never says an animal word.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from skyrl_lora.rl_accounting import (
    OffPolicyConfig,
    TokenWeights,
    group_advantages,
    token_weights,
)
from skyrl_lora.server.embedded.builder import TARGET_MODULES, load_model
from skyrl_lora.types import SampledSequence


@dataclass(frozen=True)
class LearnerConfig:
    rank: int = 8
    alpha: int = 16
    lr: float = 7e-3
    seed: int = 0
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


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

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)


class Learner:
    """Holds the LoRA weights and the optimizer of one tenant."""

    def __init__(self, model_dir: Path, targets: frozenset[int], config: LearnerConfig) -> None:
        self.targets = targets
        self.config = config
        torch.manual_seed(config.seed)  # the LoRA A init: same seed, same start
        lora = LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            target_modules=list(TARGET_MODULES),
            lora_dropout=0.0,
        )
        self.model = get_peft_model(load_model(model_dir), lora)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(params, lr=config.lr)

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
        logits = self.model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
        targets = ids[:, len(prompt) :]
        lp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        mask = torch.zeros_like(lp, dtype=torch.bool)
        for i, s in enumerate(seqs):
            mask[i, : len(s.tokens)] = True
        return lp * mask

    def step(self, groups: Sequence[Group], trainer_version: int) -> StepResult:
        """One GRPO update: loss = -sum(advantage * clipped ratio * logprob) / kept tokens.

        The ratio is a constant weight (truncated importance sampling), so the
        gradient is the off-policy-corrected policy gradient. Runs in a worker
        thread; torch releases the GIL in its kernels.
        """
        self.model.train()
        rewards: list[float] = []
        accounts: list[TokenWeights] = []
        terms: list[torch.Tensor] = []
        for group in groups:
            group_rewards = [self.reward(s) for s in group.sequences]
            advantages = group_advantages(group_rewards)
            logprobs = self.token_logprobs(group.prompt, group.sequences)
            for i, (seq, adv) in enumerate(zip(group.sequences, advantages)):
                row = logprobs[i, : len(seq.tokens)]
                account = token_weights(seq, row.tolist(), trainer_version, self.config.off_policy)
                weights = torch.tensor(account.weights)
                terms.append((adv * weights * row).sum())
                accounts.append(account)
            rewards.extend(group_rewards)
        kept = max(sum(a.kept_count for a in accounts), 1)
        loss = -torch.stack(terms).sum() / kept
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return StepResult(tuple(rewards), tuple(accounts), float(loss.detach()))

    def save(self, folder: Path) -> Path:
        """PEFT's ``save_pretrained``: adapter_config.json + adapter_model.safetensors."""
        self.model.save_pretrained(str(folder))
        return folder


# -- the learner in its own process -------------------------------------------
# A step is mostly small torch calls from Python: run in a thread of the
# sampling process it holds the GIL, and the samplers' event loop (which
# sends requests and reads answers) stalls for the whole step. In a process
# of its own it shares nothing with the samplers but the CPU.

_LEARNER: Learner | None = None


def _start(model_dir: Path, targets: frozenset[int], config: LearnerConfig) -> None:
    global _LEARNER
    torch.set_num_threads(1)  # several trainers and the server share a few cores
    _LEARNER = Learner(model_dir, targets, config)


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

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    def __enter__(self) -> LearnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
