"""The request bodies the service takes, as pydantic models (strict, extra fields
forbidden): OpenAI's /v1/completions and /v1/chat/completions, llama-server's /completion,
/tokenize, /detokenize and /apply-template; and how a body is refused (`validation_error`).

Why strict models: a value of the wrong type or out of range is a 400 naming its field
before anything reaches the worker (`mtplib.serve.fields` refuses the unknown and inert
fields first)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mtplib.errors import InputError
from mtplib.runtime.grammar import check_grammar
from mtplib.runtime.structured import GrammarSpec, constraint_from_request
from mtplib.serve.errors import ApiError

#: OpenAI's bound on stop sequences per request, and ours on their length
MAX_STOPS, MAX_STOP_CHARS = 4, 256
#: the most alternatives per token a response lists (OpenAI's top_logprobs bound)
MAX_LOGPROBS = 20


class BaseRequest(BaseModel):
    """Fields every generating endpoint takes (`mtplib.serve.fields.HONOURED`). A field
    in no list, or an inert one at a value that would do something, was refused before
    this model (`mtplib.serve.fields.refusal`); extra="forbid" is the net under that."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    #: -1 (llama-server's): until the end of generation or the context
    max_tokens: int | None = Field(None, ge=-1)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's name
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    #: -1 (llama-server's): a random seed, drawn per request and reported
    seed: int | None = Field(None, ge=-1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # llama-server's: generate exactly max_tokens
    return_tokens: bool = False  # llama-server's: add the generated token ids
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    #: OpenAI's {"id": bias}; llama-server's [[id, bias | false], ...] too, and either
    #: keyed by text ({" word": -100}, [[" word", false]]): every token of the text
    logit_bias: dict[str, float | bool] | list[list[int | float | bool | str]] | None = None
    #: structured output (`constraint`): llama-server's GBNF ``grammar`` and
    #: ``json_schema``, OpenAI's and llama-server's ``response_format``
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    #: choices per prompt: OpenAI's ``n``, llama-server's ``n_cmpl`` (its alias of n)
    n: int | None = Field(None, ge=1)
    n_cmpl: int | None = Field(None, ge=1)
    #: llama-server's: each streamed event carries the timings so far
    timings_per_token: bool = False
    #: llama-server's: a stream reports the prompt's processing (``prompt_progress``)
    return_progress: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a value mtplib does not do."""
        stops = self.stop_list()
        if len(stops) > MAX_STOPS or any(not x or len(x) > MAX_STOP_CHARS for x in stops):
            return "stop", (f"stop takes up to {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters")
        opts = set(self.stream_options or {}) - {"include_usage"}
        if opts:
            return "stream_options", f"stream_options.{sorted(opts)[0]} is not supported"
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def n_new(self, default: int) -> int:
        """The tokens asked for (-1: as many as the context holds)."""
        for v in (self.max_tokens, self.n_predict):
            if v is not None:
                return v
        return default

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def bias(self, n_vocab: int) -> tuple[tuple[int, float], ...]:
        """logit_bias's entries keyed by token id as (token id, bias); false (llama-
        server's) bans a token (-inf). The text-keyed ones are `bias_texts`."""
        return tuple((int(k), b) for k, b in self._bias_items(n_vocab) if isinstance(k, int))

    def bias_texts(self) -> tuple[tuple[str, float], ...]:
        """logit_bias's entries keyed by text, as (text, bias): llama-server tokenizes the
        text (no BOS) and biases each of its tokens (`mtplib.serve.generation`)."""
        return tuple((k, b) for k, b in self._bias_items(0) if isinstance(k, str))

    def _bias_items(self, n_vocab: int) -> list[tuple[int | str, float]]:
        if not self.logit_bias:
            return []
        if isinstance(self.logit_bias, dict):  # a key of digits is an id, else text
            items = [(int(k) if _ID.fullmatch(k.strip()) else k, b)
                     for k, b in self.logit_bias.items()]
        else:
            items = [tuple(x) for x in self.logit_bias]
        return [_bias_entry(item, n_vocab) for item in items]

    def n_choices(self) -> int:
        """Completions per prompt (``n``, or llama-server's ``n_cmpl``)."""
        if self.n is not None and self.n_cmpl is not None and self.n != self.n_cmpl:
            raise ApiError(400, f"n={self.n} and n_cmpl={self.n_cmpl} disagree: give one "
                           "(n_cmpl is llama-server's name for n)", param="n_cmpl")
        return self.n or self.n_cmpl or 1

    def constraint(self) -> GrammarSpec | None:
        """The grammar the response must follow (None: unconstrained), parsed by upstream's
        parser now: a bad grammar or schema is a 400 naming it, before any generation."""
        if self.grammar is None and self.json_schema is None and self.response_format is None:
            return None
        param = ("grammar" if self.grammar else "response_format"
                 if self.response_format is not None else "json_schema")
        try:
            spec = constraint_from_request(grammar=self.grammar, json_schema=self.json_schema,
                                           response_format=self.response_format)
            if spec is not None:
                check_grammar(spec)
        except InputError as e:
            raise ApiError(400, str(e), param=param) from None
        if spec is not None and self.ignore_eos:
            raise ApiError(400, "ignore_eos cannot go with a grammar or JSON schema: the "
                           "response ends where the grammar is complete", param="ignore_eos")
        return spec

    def n_logprobs(self) -> int | None:
        """How many top alternatives per token the response carries (None: no logprobs)."""
        return None


_ID = re.compile(r"-?[0-9]+")


def _bias_entry(item: tuple, n_vocab: int) -> tuple[int | str, float]:
    """(token id or text, bias); ``n_vocab`` 0: ids are not checked (text entries only
    are read)."""
    if len(item) != 2:
        raise ApiError(400, "logit_bias entries are [token id or text, bias]",
                       param="logit_bias")
    tok, b = item
    if isinstance(tok, str):
        if not tok:
            raise ApiError(400, "logit_bias: an empty text has no tokens to bias",
                           param="logit_bias")
    elif isinstance(tok, bool) or not isinstance(tok, int) or n_vocab and not \
            0 <= tok < n_vocab:
        raise ApiError(400, f"logit_bias token {tok!r} is not an id in [0, {n_vocab})",
                       param="logit_bias")
    if b is True or isinstance(b, str):
        raise ApiError(400, f"logit_bias bias {b!r} is not a number (false bans)",
                       param="logit_bias")
    return tok, -math.inf if b is False else float(b)


#: one prompt (text, ids, llama-server's mix of ids and text) or several (`prompts_of`)
PROMPT_SHAPE = str | list[int | str | list[int | str]]


class NativeRequest(BaseRequest):
    """llama-server's ``/completion``."""

    prompt: PROMPT_SHAPE
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    response_fields: list[str] | None = None
    #: with n_probs: the probabilities after the sampling chain (``prob``, ``top_probs``)
    post_sampling_probs: bool = False

    def n_logprobs(self) -> int | None:
        return self.n_probs or None


class CompletionRequest(BaseRequest):
    """OpenAI's ``/v1/completions``."""

    prompt: PROMPT_SHAPE
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def n_logprobs(self) -> int | None:
        return self.logprobs


def prompts_of(p: str | list) -> list[str | list[int | str]]:
    """The request's prompts, as llama-server reads them: a list holding no token id is
    several prompts (each text, ids, or a mix: ``["a", [1, 2]]``), anything else one
    (text, ids, or ids mixed with text: ``[1, "a", 2]``)."""
    if isinstance(p, list) and p and not any(isinstance(x, int) for x in p):
        out = [x for x in p]
    else:
        out = [p]
    for i, x in enumerate(out):
        if isinstance(x, list) and not x:
            where = "prompt" if len(out) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"{where} is empty", param="prompt")
        if isinstance(x, list) and any(isinstance(y, list) for y in x):
            raise ApiError(400, f"prompt[{i}] nests lists: a prompt is text, token ids, "
                           "or ids mixed with text", param="prompt")
    if isinstance(p, list) and not p:
        raise ApiError(400, "prompt is empty", param="prompt")
    return out


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    #: OpenAI's other message fields: refused unless empty (no tools, no names)
    name: None = None
    tool_calls: list[None] | None = Field(None, max_length=0)
    function_call: None = None
    refusal: None = None
    audio: None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(BaseRequest):
    """OpenAI's ``/v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=-1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def n_new(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().n_new(default)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]


class TemplateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    messages: list[ChatMessage] = Field(min_length=1)


def validation_error(e: ValidationError | RequestValidationError) -> ApiError:
    """The first error, named by its field; FastAPI's (a query parameter) start their loc
    with where the field was ("query", "path"), which is no part of its name."""
    first = e.errors()[0]
    where = first["loc"][1:] if isinstance(e, RequestValidationError) else first["loc"]
    loc = ".".join(str(x) for x in where)
    return ApiError(400, f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None)


def validate(kind: type[BaseModel], data: dict) -> Any:
    """``data`` as ``kind``, or the 400 naming the first bad field."""
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
