"""Pieces of the multi-tenant RL example: PEFT learner, async tenant loop, report."""
