"""The Tinker API's sampling surface, so the official Tinker SDK samples unchanged.

Owns everything under ``/api/v1``: the session handshake the SDK performs,
``asample`` and ``retrieve_future``, the protobuf ``SampleResponse``, the
bounded store of futures, and the runner that takes a sample to completion
across adapter pauses (stitching aborted segments as ``sample_with_retry``
does on the client). Training calls answer "not supported". It sits below
``http``: the app injects the sampler and the key lookup (see ``routes``).
"""
