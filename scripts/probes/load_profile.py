"""Where the staged (off-loop) load of a rank-16 adapter spends its time.

In-process engine on the perf model (eager, to start fast). Inside the
worker, six loads of vLLM's ``WorkerLoRAManager._load_adapter`` are timed and
the last five profiled (cProfile, by own time), then the same loads with a
steady decode running on another thread, as in a swap under load.
Usage: bash scripts/gpu_device_run.sh run python3 scripts/probes/load_profile.py
"""
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.getcwd())
from gpu_tests.perf_model import build_perf_model, write_random_adapter  # noqa: E402

root = Path(tempfile.mkdtemp(prefix="loadprof-"))
model = build_perf_model(root)
ads = [str(write_random_adapter(model.model_dir, root / f"a{i}", 16, seed=70 + i)) for i in range(8)]

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

llm = LLM(model=str(model.model_dir), enable_lora=True, max_lora_rank=64, max_loras=8,
          dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3, enforce_eager=True)
llm.generate([{"prompt_token_ids": list(range(10, 74))}], SamplingParams(max_tokens=4),
             lora_request=LoRARequest("warm", 1, ads[0]))


def loads(worker, paths, base_id):
    wm = worker.model_runner.lora_manager
    times = []
    prof = cProfile.Profile()
    for i, p in enumerate(paths):
        if i == 1:
            prof.enable()
        t0 = time.perf_counter()
        wm._load_adapter(LoRARequest(f"l{base_id + i}", base_id + i, p))
        times.append(round((time.perf_counter() - t0) * 1000, 2))
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    return times, s.getvalue()[:6000]


times, text = llm.collective_rpc(loads, args=(ads[1:7], 300))[0]
print("idle engine, load ms (first cold):", times)
print(text)

# The same loads on a thread while the engine decodes 32 sequences.
import threading  # noqa: E402

eng = llm.llm_engine
sp = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0)
for j in range(32):
    eng.add_request(f"d{j}", {"prompt_token_ids": list(range(10, 74))}, sp,
                    lora_request=LoRARequest("warm", 1, ads[0]))
result = {}


def bg(worker, paths):
    def run():
        sys.setswitchinterval(0.0005)
        result["r"] = loads(worker, paths, 500)
    t = threading.Thread(target=run)
    t.start()
    worker._probe_thread = t
    return True


def join(worker):
    worker._probe_thread.join()
    return result["r"]


llm.collective_rpc(bg, args=(ads[1:7],))
steps = []
while True:
    t = time.perf_counter()
    eng.step()
    steps.append((time.perf_counter() - t) * 1000)
    if not llm.collective_rpc(lambda w: w._probe_thread.is_alive())[0]:
        break
times, text = llm.collective_rpc(join)[0]
steps.sort()
print(f"under decode load, load ms: {times}; steps n {len(steps)} p50 {steps[len(steps)//2]:.2f} max {steps[-1]:.2f}")
print(text[:3000])
