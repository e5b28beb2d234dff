"""The engine as tenants see it: every ``generate`` passes a per-adapter gate.

Owns the gate (``gate``: pure admission, pause, drain; no vLLM) and the gated
engine (``gated``: wraps vLLM's engine client, pauses, aborts and swaps
adapter versions through ``adapters`` and ``loading``), and, on the CPU
build, the scheduler that has every new KV block zeroed (``kv_zeroing``: vLLM-CPU's attention
reads a block's unwritten slots, so one tenant's NaN would reach another),
and, on a GPU, the step budget cut to the largest CUDA graph
(``step_budget``: pure, reads the parsed flags).
May import ``loading``, ``transfer``, ``adapters`` and the server's base modules.
"""
