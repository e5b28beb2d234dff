"""What the server says about itself while it runs: metrics, event lines, watches.

Owns the ``/metrics`` collectors and the structured ``skyrl_event`` lines
(``observability``), reading those lines back on a client's clock
(``event_log``: standard library only, for benchmarks and reports), the API
server's event-loop and garbage-collector watch (``loop_monitor``) and the
engine's long-step log (``step_watch``).

Part of the server's base, beside ``compat``: every other package may import
it. May import only the standard library, Prometheus's client and
``skyrl_lora`` (``observability`` names the engine's gate for type checking
only).
"""
