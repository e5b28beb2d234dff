"""What an adapter is and which versions exist: names, versions, leases, files.

Owns the registry of names and versions and each version's immutable
snapshot folder (``registry``), the leases that keep a version loaded
(``leases``), the snapshot's weights file written after a swap and the wait
for it (``snapshot_writer``), an adapter's safetensors file read in one call
(``adapter_file``, its exact and parallel reads in ``chunked``), also while a
streamed push still writes it (``arrival``), and what is done to an
adapter's tensors wherever they are: refused when not finite
(``finite_check``), scaled by the LoRA scaling (``scale_fold``), on CUDA side
streams beside the engine's (``cuda_streams``).

The lowest of the weights packages: ``transfer`` and ``loading`` build on
it. May import only the server's base modules (``compat``, ``observability``).
"""
