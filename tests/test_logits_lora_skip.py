"""vLLM's LoRA on the logits runs only while a slot holds ``lm_head`` weights.

:func:`skyrl_lora.server.compat.skip_logits_lora_while_unweighted` on a
stand-in of vLLM's ``LogitsProcessorWithLoRA`` (the real one needs a model
and a device); that the real layer still computes the way it wraps is
checked on the installed vLLM, and the whole path on the CPU engine by
``tests/test_logits_lora_engine.py``.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from skyrl_lora.server import compat


class _Punica:
    """A Punica wrapper that adds one to the logits, in place, as on a GPU."""

    def __init__(self) -> None:
        self.calls = 0
        self.sampler_indices = "the wrapper's own"

    def add_lora_logits(self, y, x, lora_a, lora_b, scale):
        self.calls += 1
        y += 1


class _LogitsLoRA:
    """What the wrapping relies on: ``set_lora`` (which resets first, as vLLM's
    does), ``reset_lora``, and ``_get_logits`` asking ``punica_wrapper``."""

    def __init__(self) -> None:
        self.punica_wrapper = _Punica()

    def reset_lora(self, index: int) -> None:
        pass

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        self.reset_lora(index)

    def _get_logits(self, hidden_states, lm_head, embedding_bias=None):
        logits = hidden_states.clone()
        out = self.punica_wrapper.add_lora_logits(logits, hidden_states, None, None, 1.0)
        return logits if out is None else out


class _Manager:
    """What the slot forgetting relies on: ``lora_index_to_id`` (each slot's
    adapter id), ``modules`` and ``_deactivate_adapter`` freeing the slot."""

    def __init__(self, modules: dict) -> None:
        self.lora_index_to_id: list[int | None] = [None] * 4
        self.modules = modules

    def _deactivate_adapter(self, lora_id: int) -> None:
        self.lora_index_to_id[self.lora_index_to_id.index(lora_id)] = None


@pytest.fixture
def layer_class(monkeypatch):
    module = types.ModuleType("fake_logits_processor")
    module.LogitsProcessorWithLoRA = _LogitsLoRA  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(compat, "_LOGITS_LORA_MODULE", module.__name__)
    managers = types.ModuleType("fake_model_manager")
    managers.LoRAModelManager = _Manager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, managers.__name__, managers)
    monkeypatch.setattr(compat, "_LORA_MANAGER_MODULE", managers.__name__)
    monkeypatch.setattr(_Manager, "_deactivate_adapter", _Manager._deactivate_adapter)
    monkeypatch.delattr(_Manager, "skyrl_forgets_freed_logits_slots", raising=False)
    for name in ("set_lora", "reset_lora", "_get_logits"):
        monkeypatch.setattr(_LogitsLoRA, name, getattr(_LogitsLoRA, name))
    monkeypatch.delattr(_LogitsLoRA, "skyrl_skips_unweighted_logits_lora", raising=False)
    assert compat.skip_logits_lora_while_unweighted()
    wrapped = _LogitsLoRA._get_logits
    assert compat.skip_logits_lora_while_unweighted()  # placed again: not wrapped twice
    assert _LogitsLoRA._get_logits is wrapped
    return _LogitsLoRA


def test_the_logits_lora_runs_only_while_a_slot_holds_weights(layer_class) -> None:
    layer = layer_class()
    punica = layer.punica_wrapper
    hidden = torch.zeros(2, 4)

    def logits_moved() -> bool:
        got = layer._get_logits(hidden, "lm_head")
        assert layer.punica_wrapper is punica  # given back after each call
        return bool((got == 1).all())

    assert not logits_moved() and punica.calls == 0  # no slot written yet
    layer.set_lora(2, "a", "b")  # vLLM's own write
    assert logits_moved() and punica.calls == 1
    compat.note_lora_slot_written(layer, 5, True)  # the slot writer's replay: no set_lora
    layer.reset_lora(2)
    assert logits_moved()  # slot 5 still holds weights
    compat.note_lora_slot_written(layer, 5, False)
    assert not logits_moved() and punica.calls == 2


def test_a_deactivated_adapters_slot_stops_counting(layer_class) -> None:
    """vLLM frees the slot of an adapter it deactivates (unload, LRU eviction)
    without zeroing it; no row maps to a free slot, so the logits skip the
    LoRA again, and a slot written again counts again."""
    layer = layer_class()
    manager = _Manager({"lm_head": layer, "q_proj": torch.nn.Linear(2, 2)})
    hidden = torch.zeros(2, 4)
    manager.lora_index_to_id[1:3] = [7, 8]
    layer.set_lora(1, "a", "b")  # adapter 7 holds lm_head weights
    layer.set_lora(2, "a", "b")  # and adapter 8
    manager._deactivate_adapter(7)
    assert manager.lora_index_to_id[1] is None  # vLLM's own work still done
    assert compat._logits_lora_slots[layer] == {2}
    manager._deactivate_adapter(8)
    assert not compat._logits_lora_slots[layer]
    assert not bool((layer._get_logits(hidden, "lm_head") == 1).all())
    layer.set_lora(2, "a", "b")
    assert bool((layer._get_logits(hidden, "lm_head") == 1).all())


def test_other_layers_are_not_tracked(layer_class) -> None:
    other = torch.nn.Linear(2, 2)
    compat.note_lora_slot_written(other, 1, True)
    compat.note_lora_slot_written(types.SimpleNamespace(), 1, True)  # nor need they be modules
    assert other not in compat._logits_lora_slots


def test_the_installed_vllm_layer_computes_as_the_wrapping_expects() -> None:
    """The real layer asks its ``punica_wrapper`` for ``add_lora_logits`` inside
    ``_get_logits``, and its ``set_lora`` / ``reset_lora`` take the slot first."""
    module = pytest.importorskip(compat._LOGITS_LORA_MODULE)
    cls = module.LogitsProcessorWithLoRA
    assert callable(cls._get_logits)
    assert "self.punica_wrapper.add_lora_logits(" in inspect.getsource(module)
    for name in ("set_lora", "reset_lora"):
        params = list(inspect.signature(getattr(cls, name)).parameters)
        assert params[:2] == ["self", "index"], (name, params)


def test_the_installed_vllm_manager_frees_slots_as_the_forgetting_expects() -> None:
    """The real manager frees a slot in ``_deactivate_adapter(lora_id)`` through
    ``lora_index_to_id``, holds its layers in ``modules``, binds that method
    into its LRU cache as it is made (so the class is patched first), and its
    ``activate_adapter`` writes every layer's slot (``set_lora`` or
    ``reset_lora``)."""
    module = pytest.importorskip(compat._LORA_MANAGER_MODULE)
    cls = module.LoRAModelManager
    params = list(inspect.signature(cls._deactivate_adapter).parameters)
    assert params == ["self", "lora_id"], params
    assert "lora_index_to_id" in inspect.getsource(cls._deactivate_adapter)
    init = inspect.getsource(cls.__init__)
    assert "self.modules" in init and "self._deactivate_adapter" in init
    activate = inspect.getsource(cls.activate_adapter)
    assert "set_lora(" in activate and "reset_lora(" in activate
