"""What the service knows of the loaded model and its own limits (`ServeConfig`), and the
model's facts read from its GGUF header and from the backend (`ModelFacts`), not from
upstream's API (the header is already parsed once, by the run request)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mtplib.runtime.backend import Backend


@dataclass
class ServeConfig:
    """What the HTTP layer knows of the loaded model and its own limits."""

    model_id: str
    n_ctx: int
    n_vocab: int
    #: end-of-generation token ids (from the GGUF): a generation stops at one
    eog: frozenset[int] = frozenset()
    k: int = 0
    default_n: int = 32
    default_temperature: float = 0.0
    default_top_p: float = 1.0
    default_seed: int = 0
    #: requests that may wait behind the running one; more are answered 503
    queue_max: int = 8
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    #: the GGUF's tokenizer.chat_template (None: ChatML, as llama-server); with
    #: chat_format, the name or text that format was chosen by (what /props shows)
    chat_template: str | None = None
    #: messages -> prompt text: upstream's built-in format (--chat-template NAME,
    #: --no-jinja; `commands.chat_templates`), used instead of chat_template's Jinja
    chat_format: Callable[[list[dict]], str] | None = None
    bos_token: str = ""
    eos_token: str = ""
    meta: dict = field(default_factory=dict)
    #: the trunk's path (/props' model_path; default: model_id)
    model_path: str = ""
    #: system_fingerprint and /props' build_info: mtplib's and upstream's builds
    fingerprint: str = "mtplib"
    #: the BOS id the tokenizer adds (None: it adds none)
    bos_id: int | None = None
    #: CORS: origins a browser page may call from ("*": any; empty: no CORS headers)
    cors_origins: tuple[str, ...] = ("*",)


@dataclass(frozen=True)
class ModelFacts:
    """The model's end-of-generation ids, chat template and BOS/EOS as the service uses
    them."""

    n_vocab: int
    eog: frozenset[int]
    chat_template: str | None
    bos_token: str
    eos_token: str
    bos_id: int | None


def model_facts(header: Any, backend: Backend) -> ModelFacts:
    """``header``: the trunk's parsed GGUF header (``.kv``, ``.n_vocab``)."""
    kv = header.kv
    toks = kv.get("tokenizer.ggml.tokens")
    eog = {kv.get(f"tokenizer.ggml.{n}_token_id") for n in ("eos", "eot", "eom")}

    def text(key: str) -> str:
        t = kv.get(f"tokenizer.ggml.{key}_token_id")
        return str(toks[t]) if isinstance(toks, list) and isinstance(t, int) \
            and 0 <= t < len(toks) else ""

    template = kv.get("tokenizer.chat_template")
    return ModelFacts(
        n_vocab=header.n_vocab,
        eog=frozenset(int(t) for t in eog if isinstance(t, int) and not isinstance(t, bool)),
        chat_template=template if isinstance(template, str) else None,
        bos_token=text("bos"), eos_token=text("eos"), bos_id=bos_id(backend))


def bos_id(backend: Backend) -> int | None:
    """The token the backend's tokenize puts before any text (its BOS), None if none:
    read from the backend itself (an empty text), not guessed from the header."""
    try:
        toks = backend.tokenize("")
    except Exception:  # noqa: BLE001 - a tokenizer that refuses "" adds nothing we know of
        return None
    return int(toks[0]) if len(toks) == 1 else None


def fingerprint(upstream: dict) -> str:
    """system_fingerprint and /props' build_info: the upstream build mtplib runs on."""
    up = upstream or {}
    return f"mtplib-{up.get('build', '?')}-{str(up.get('patch_set_sha256', '?'))[:12]}"
