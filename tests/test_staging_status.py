"""How the API server learns that a staging is ready, against a scripted engine.

The workers publish each staging's status as a file the API server polls
(no call into the engine's step loop); a version staged on every worker is
then installed by its first request, so ``add_lora`` calls nothing. A
status file that never comes (its write failed) must not hang the load: the
workers are still asked by RPC once a ``rpc_check_s``. The real engine runs
all of this in every engine test; here each path is forced on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from skyrl_lora.server.loading.staged_engine import StagedLoRAEngine, StagingConfig
from skyrl_lora.server.loading.staging_status import READY, status_file


class ScriptedEngine:
    """An engine client whose one worker stages at once and publishes (or not)."""

    def __init__(self, publish: bool) -> None:
        self.publish = publish
        self.status_dir: Path | None = None
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        if method == "skyrl_start_staging":
            self.status_dir = Path(args[3])
            return [
                {
                    "slot_prefill": True,
                    "reader_process": False,
                    "staging_yield": True,
                    "device_uuid": None,
                    "status_files": True,
                    "worker": "w0",
                }
            ]
        status = {"state": READY, "in_slot": True, "read": "one_buffer", "naps": 0}
        if method == "skyrl_stage_lora":
            if self.publish:
                assert self.status_dir is not None
                path = self.status_dir / status_file(args[0]["lora_int_id"], "w0")
                path.write_text(json.dumps(status))
            return [None]
        if method == "skyrl_lora_staged":
            return [status]
        return [None]

    async def add_lora(self, lora_request: Any) -> bool:
        self.calls.append("add_lora")
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append("remove_lora")
        return True


def request(lora_id: int) -> Any:
    return SimpleNamespace(lora_name=f"a@v{lora_id}", lora_int_id=lora_id, lora_path="/x")


async def test_a_published_status_is_read_from_its_file_and_the_install_is_left_to_vllm() -> None:
    engine = ScriptedEngine(publish=True)
    staged = StagedLoRAEngine(engine)
    assert await staged.probe()
    await staged.stage(request(7))
    assert "skyrl_lora_staged" not in engine.calls  # no call into the step loop
    assert engine.status_dir is not None and list(engine.status_dir.iterdir()) == []
    assert await staged.add_lora(request(7))
    assert "add_lora" not in engine.calls  # its first request installs it
    await staged.remove_lora(7)
    assert await staged.add_lora(request(7))  # not staged any more: a real add_lora
    assert engine.calls.count("add_lora") == 1


async def test_a_status_file_that_never_comes_falls_back_to_asking_the_workers() -> None:
    engine = ScriptedEngine(publish=False)
    staged = StagedLoRAEngine(engine, StagingConfig(rpc_check_s=0.05, timeout_s=5.0))
    assert await staged.probe()
    await staged.stage(request(8))
    assert "skyrl_lora_staged" in engine.calls


def test_the_extension_vllm_loads_by_name_is_the_workers_staging() -> None:
    """vLLM imports the workers' side by the name the API server gives it."""
    import importlib

    from skyrl_lora.server.loading.staged_engine import EXTENSION_QUALNAME
    from skyrl_lora.server.loading.staging import LoRAStagingExtension

    module, _, name = EXTENSION_QUALNAME.rpartition(".")
    assert getattr(importlib.import_module(module), name) is LoRAStagingExtension
