"""The engine as tenants see it: every ``generate`` passes a per-adapter gate.

Owns the gate (``gate``: pure admission, pause, drain; no vLLM) and the gated
engine (``gated``: wraps vLLM's engine client, pauses, aborts and swaps
adapter versions through ``weights``). May import ``weights`` and the
server's top-level modules.
"""
