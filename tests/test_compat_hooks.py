"""Hooks on vLLM's methods (``compat._hook_before``) and the prompt counts the gate paces by.

Several concerns hook one method (the staging naps and the step watch both
hook the model runner's ``execute_model``): each hook is kept by name, sees
the call's arguments, and placing it again replaces it instead of wrapping
the wrapper. The gate's step signal hooks the API server's output
processor the same way.
"""

from __future__ import annotations

from typing import Any

from skyrl_lora.server import compat


class ModelRunner:
    def __init__(self) -> None:
        self.steps: list[Any] = []

    def execute_model(self, scheduler_output: Any, intermediate: Any = None) -> str:
        self.steps.append(scheduler_output)
        return "output"


def test_hooks_on_one_method_are_kept_by_name_and_see_the_calls_arguments() -> None:
    runner = ModelRunner()
    naps: list[int] = []
    watched: list[Any] = []
    assert compat.call_before_model_steps(runner, lambda: naps.append(1))
    assert compat.watch_model_steps(runner, watched.append)
    assert runner.execute_model("step-1") == "output"
    assert runner.execute_model(scheduler_output="step-2") == "output"
    assert runner.steps == ["step-1", "step-2"]
    assert naps == [1, 1] and watched == ["step-1", "step-2"]
    # Placed again, a hook replaces its earlier self: the method is wrapped once.
    again: list[Any] = []
    assert compat.watch_model_steps(runner, again.append)
    runner.execute_model("step-3")
    assert watched == ["step-1", "step-2"] and again == ["step-3"] and naps == [1, 1, 1]
    assert isinstance(runner.execute_model, compat._HookedCall)
    assert runner.execute_model.original.__self__ is runner  # the bound method itself


def test_nothing_to_hook_is_said_not_raised() -> None:
    assert not compat.call_before_model_steps(None, lambda: None)
    assert not compat.watch_model_steps(object(), lambda output: None)
    assert not compat.call_after_engine_steps(object(), lambda running: None)


def test_the_gates_step_signal_runs_as_each_batch_of_outputs_is_handed_out() -> None:
    class OutputProcessor:
        def __init__(self) -> None:
            self.stats: list[Any] = []

        def update_scheduler_stats(self, scheduler_stats: Any) -> None:
            self.stats.append(scheduler_stats)

    class EngineClient:
        output_processor = OutputProcessor()

    class Stats:
        num_running_reqs = 3

    client = EngineClient()
    steps: list[int | None] = []
    assert compat.call_after_engine_steps(client, steps.append)
    client.output_processor.update_scheduler_stats(None)  # a server logging no stats
    stats = Stats()
    client.output_processor.update_scheduler_stats(stats)
    # each batch is a step, with the requests it ran where the stats say
    assert steps == [None, 3] and client.output_processor.stats == [None, stats]


def test_the_real_output_processor_has_the_method_the_step_signal_hooks() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    assert callable(getattr(OutputProcessor, "update_scheduler_stats", None))


def test_prompt_token_counts() -> None:
    assert compat.prompt_token_count({"prompt_token_ids": [1, 2, 3]}) == 3
    assert compat.prompt_token_count(compat.tokens_prompt([4, 5])) == 2

    class Processed:
        prompt_token_ids = [7] * 9

    assert compat.prompt_token_count(Processed()) == 9
    # What 0.32's OpenAI routes hand ``generate`` for a token or rendered text prompt.
    from vllm.inputs.engine import tokens_input

    assert compat.prompt_token_count(tokens_input([1, 2, 3, 4])) == 4
    assert compat.prompt_token_count("a text prompt") is None
    assert compat.prompt_token_count({"prompt": "text"}) is None


def test_prompt_logits_per_request_placed_twice_wraps_vllms_method_once() -> None:
    """Should the staging extension be installed again in the same worker,
    the second placement replaces the first wrapper instead of wrapping it."""
    from types import SimpleNamespace

    from skyrl_lora.server.compat import per_request_prompt_logits

    calls = []

    def vllms(hidden_states: object) -> str:
        calls.append(hidden_states)
        return "prompt logprobs"

    punica = SimpleNamespace(_sampler_indices=[], _token_lora_indices=[], indices_len=[0, 0])
    manager = SimpleNamespace(punica_wrapper_mapping={"model": punica})
    runner = SimpleNamespace(
        _get_prompt_logprobs_dict=vllms,
        model=SimpleNamespace(),
        lora_manager=SimpleNamespace(_adapter_manager=manager),
        num_prompt_logprobs={},  # no request asked for prompt logprobs this step
    )
    assert per_request_prompt_logits(runner)
    first = runner._get_prompt_logprobs_dict
    assert per_request_prompt_logits(runner)
    assert runner._get_prompt_logprobs_dict is not first
    assert runner._get_prompt_logprobs_dict.skyrl_wrapped is vllms
    assert runner._get_prompt_logprobs_dict("hidden") == "prompt logprobs"
    assert calls == ["hidden"]
