"""The HTTP surface: vLLM's OpenAI app with our routes, keys and sample added.

Owns the app and its start-up (``app``), the ``/skyrl/v1`` routes
(``routes``), API keys scoped to adapters (``auth``), the token-in ``sample``
route (``sample``) and adapter uploads (``push``; over a stream of their
own, ``push_stream``, each push's lanes meeting in ``push_assembly``,
received in a process of their own, ``push_stream_process``, into shared
memory, ``receive_area``, which the other servers of the host load the
same push from, ``push_shared``). May import
``tinker``, ``engine``, ``loading``, ``transfer``, ``adapters`` and the
server's base modules.
"""
