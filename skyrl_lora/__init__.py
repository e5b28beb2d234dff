"""skyrl-lora: multi-tenant LoRA inference for RL training on vLLM.

The top-level package is the dependency-light core shared by the client and
the server: wire types (:mod:`skyrl_lora.types`), the exception hierarchy
(:mod:`skyrl_lora.errors`) and the pure logic that stitches aborted samples
back together (:mod:`skyrl_lora.stitching`). It imports nothing heavier than
pydantic so that a trainer can depend on the client without pulling in vLLM.
"""

from skyrl_lora.errors import (
    AdapterNotFoundError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    FanOutError,
    HandoverUnavailableError,
    InternalServerError,
    LeaseNotFoundError,
    NonFiniteLogitsError,
    PayloadTooLargeError,
    PermissionDeniedError,
    PushStreamUnavailableError,
    RequestTimeoutError,
    ResponseFormatError,
    RetryLimitError,
    ServerError,
    ServerUnavailableError,
    SkyRLLoraError,
    VersionGoneError,
)
from skyrl_lora.types import (
    SampledSequence,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    StopReason,
    VersionRange,
)

__all__ = [
    "AdapterNotFoundError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "FanOutError",
    "HandoverUnavailableError",
    "InternalServerError",
    "LeaseNotFoundError",
    "NonFiniteLogitsError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PushStreamUnavailableError",
    "RequestTimeoutError",
    "ResponseFormatError",
    "RetryLimitError",
    "SampleRequest",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "ServerError",
    "ServerUnavailableError",
    "SkyRLLoraError",
    "StopReason",
    "VersionGoneError",
    "VersionRange",
]
