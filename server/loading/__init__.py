"""How a version reaches an engine LoRA slot beside the step loop, not inside it.

Owns staging, both sides of it: the workers' (``staging``, vLLM's worker
extension: a thread that builds the version's model and writes its slot;
its naps that leave the GIL to the step loop, ``staging_yield``; an opt-in
profile, ``staging_profile``) and the API server's (``staged_engine``, which
asks over ``stage_channel`` and waits for each worker's ``staging_status``);
a staging's bytes as one buffer on the host or the GPU (``staged_buffer``);
and the slot write itself (``slots``, batched into a few tensor calls:
``slot_batch``).

The highest of the weights packages. May import ``transfer``, ``adapters``
and the server's base modules.
"""
