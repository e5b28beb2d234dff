"""The JSON the Tinker SDK sends, and the error shape it understands.

Only the fields we act on are modelled; everything else the SDK sends (its
``type`` tags, telemetry hints, fields of newer SDKs) is ignored, so a newer
SDK that adds an optional field keeps working. Options we cannot honour are
modelled so that asking for them is a clear error rather than silently lost.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

ErrorCategory = Literal["user", "server"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class Chunk(_Lenient):
    """One prompt chunk: only ``encoded_text`` (token ids) is supported."""

    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInput(_Lenient):
    chunks: list[Chunk] = Field(default_factory=list)


class TinkerSamplingParams(_Lenient):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class AsampleRequest(_Lenient):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: TinkerSamplingParams = Field(default_factory=TinkerSamplingParams)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, object] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


class CreateSamplingSessionRequest(_Lenient):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class FutureRequest(_Lenient):
    request_id: str


class TinkerError(Exception):
    """An error the Tinker surface answers as ``{error, category}``.

    ``user`` errors are the caller's to fix (the SDK does not retry them);
    ``server`` errors are ours.
    """

    def __init__(self, message: str, *, status: int = 400, category: ErrorCategory = "user"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.category: ErrorCategory = category


def error_json(message: str, category: ErrorCategory, status: int = 200) -> JSONResponse:
    """Tinker's failure shape. A failed future is answered with 200: any other
    4xx from ``retrieve_future`` reads to the SDK as a transport problem."""
    return JSONResponse({"error": message, "category": category}, status_code=status)
