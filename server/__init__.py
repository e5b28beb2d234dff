"""The skyrl-lora server: vLLM's OpenAI server plus per-adapter pause.

Layers, lowest first; each imports only from those below it::

    cli, demo, __main__         entry points: ``skyrl-lora serve | demo | build-model``
    cluster/                    Ray: the server actor, replica groups, replay of a replica
    http/                       the HTTP surface: app, /skyrl/v1 routes, keys, sample, push
    tinker/                     the Tinker SDK's sampling surface, mounted by http/
    engine/                     the gate in front of vLLM's ``generate``, the gated engine
                                and the CPU build's scheduler that zeroes new KV blocks
    loading/                    a version into an engine LoRA slot beside the step loop:
                                staging (both sides), its buffers, the slot write
    transfer/                   an adapter's bytes onto the engine's host: hand-overs,
                                receive areas to the GPU, the reader process, host memory
    adapters/                   what an adapter is and which versions exist: registry,
                                leases, snapshot files, one-call file reads, tensor checks
    compat, telemetry/,         the base: the one door to vLLM; metrics, event lines and
    logits_guard,               the loop and step watches; the sampler's guard against
    lora_metadata, reaper,      non-finite logits; the LoRA kernels' metadata prepared on
    presets, embedded/,         the host; process cleanup; the embedded model's flags and
    kernels/                    builder; grouped LoRA kernels

``tests/test_import_layers.py`` checks the order and that nothing imports in
a cycle. Importing this package is cheap: the modules that need vLLM import
it themselves, so ``skyrl_lora.server.embedded`` (the tiny model builder) and
the CLI's help work before the engine is loaded.
"""
