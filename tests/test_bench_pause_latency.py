"""The pause-latency benchmark's flags and its GPU server's argv, checked without a server.

The GPU mode cannot run on the CPU machine; what it would start can: its
``serve`` argv goes through the server's own parser here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.engine_rate import CAPTURE_SIZES
from benchmarks.pause_latency import (
    ADAPTER_OF,
    GPU_IN_FLIGHT,
    GPU_RANK,
    PAUSED,
    PROBE,
    gpu_server_argv,
    parse_args,
)
from skyrl_lora.server.embedded import EmbeddedModel


def test_in_flight_is_a_list_of_counts_defaulting_by_mode() -> None:
    assert parse_args([]).in_flight == [64]
    assert parse_args(["--in-flight", "64,256"]).in_flight == [64, 256]
    gpu = parse_args(["--gpu", "--machine", "H200"])
    assert gpu.in_flight == GPU_IN_FLIGHT
    assert gpu.size == "0.8b"


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu", "--ab"],
        ["--size", "8b"],
        ["--machine", "H200"],
        ["--gpu", "--size", "3b"],
        ["--in-flight", "0"],
        ["--in-flight", ","],
        ["--in-flight", "many"],
        ["--rounds", "0"],
    ],
)
def test_bad_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_gpu_server_serves_the_two_tenants_at_the_step_budget_of_serve() -> None:
    from skyrl_lora.server.engine.step_budget import graph_step_budget
    from skyrl_lora.server.http.app import parse_server_args

    adapters = {name: Path(f"/m/adapters/{name}") for name in ("meow", "woof", "moo")}
    model = EmbeddedModel(Path("/m"), Path("/m/model"), adapters)
    argv = gpu_server_argv(model, 0.25)
    assert argv[0] == "--no-ray"
    args = parse_server_args(argv[1:])
    served = {m.name: m.path for m in args.lora_modules}
    assert served == {PAUSED: "/m/adapters/meow", PROBE: "/m/adapters/woof"}
    assert set(served) == set(ADAPTER_OF)
    assert (args.model, args.max_loras, args.max_lora_rank) == ("/m/model", 2, GPU_RANK)
    assert args.gpu_memory_utilization == 0.25
    assert args.compilation_config.cudagraph_capture_sizes == CAPTURE_SIZES
    # 256 of tenant A's requests and the probe's fit one step's sequences.
    budget = graph_step_budget(args, on_cpu=False)
    assert budget is not None and budget.max_num_seqs >= max(GPU_IN_FLIGHT) + 1
