"""The RL example's learner without an engine: what it hands over."""

from __future__ import annotations

from typing import Any

import torch


def test_a_learners_weights_are_views_its_training_and_reset_write_through(
    embedded_model: Any,
) -> None:
    """The learner looks its LoRA weights up once: they are views of the
    parameters, so an optimizer step and a reset (both in place) show in
    them, and they hold what PEFT's state dict holds."""
    from examples.rl.learner import Learner, LearnerConfig

    learner = Learner(embedded_model.model_dir, frozenset({1}), LearnerConfig())
    weights = learner.adapter_weights()
    assert learner.adapter_weights() is weights
    before = {k: v.clone() for k, v in weights.items()}
    for param in learner.params.values():
        param.grad = torch.ones_like(param)
    learner.optimizer.step()
    state = learner.adapter_state()
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    assert any(not torch.equal(before[k], weights[k]) for k in weights)
    learner.reset()
    assert all(torch.equal(before[k], weights[k]) for k in weights)
