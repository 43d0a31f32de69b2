"""The API's request bodies: OpenAI's schema as pydantic models, with AceSpec's own extra fields.

A body that does not fit is a 422 (FastAPI's validation, written in OpenAI's error shape by `edge/api.py`);
a value that fits the schema but that the edge cannot serve is a 400 from `EdgeService.request`.
`UNSUPPORTED` lists OpenAI's fields the edge cannot honour: a request that sets one to anything but its
neutral value is refused, never silently served without it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from acespec import wire
from acespec.edge.service import ApiError

# OpenAI fields the edge cannot honour: refused when set to anything but their neutral value
UNSUPPORTED: dict[str, tuple] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class PredictionContent(BaseModel):
    """OpenAI's Predicted Outputs: text most of the answer is expected to repeat (e.g. the file being edited)."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]


def _no_lone_surrogates(value: Any, where: str = "body") -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which no UTF-8 text can hold: refuse it here (422)
    rather than fail later while tokenizing, or while writing the error that names it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} holds a lone surrogate, which is not valid Unicode text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_lone_surrogates(k, where)
            _no_lone_surrogates(v, f"{where}.{k}" if isinstance(k, str) else where)
    elif isinstance(value, list):
        for v in value:
            _no_lone_surrogates(v, where)


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI fields the edge does not use are ignored, as vLLM does

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _no_lone_surrogates(data)
        return data

    def logprobs_asked(self) -> int:
        """HELLO.logprobs for this body (0: none; 1 + m: each token's log-probability and the m likeliest)."""
        return 0

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # chat's newer name; validated on both routes
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prediction: PredictionContent | None = None
    # AceSpec's own (extra body fields)
    rule: str | None = None
    k: int | None = Field(None, ge=0, le=64)
    top_k: int | None = Field(None, ge=0, le=1 << 31)  # past any vocabulary it changes nothing; the wire takes 64 bits
    mode: Literal["auto", "acespec", "pipelined", "sync", "cloud-only", "cloud-led"] | None = None
    marks: bool = False


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=wire.MAX_TOP_LOGPROBS)

    def logprobs_asked(self) -> int:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        return 1 + (self.top_logprobs or 0) if self.logprobs else 0


class CompletionBody(RequestBody):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=wire.MAX_TOP_LOGPROBS, strict=True)

    def logprobs_asked(self) -> int:
        return 0 if self.logprobs is None else 1 + self.logprobs
