"""A request's prompt as token ids, and how many tokens it may generate: the checks that
run before a generation starts (ids in the vocabulary, room in the context).

Why functions of the backend and the config: the same rules hold in a one-slot service and
in a batch slot, and they are tested without a worker or HTTP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtplib.serve.config import ServeConfig
from mtplib.serve.errors import ApiError


def strip_bos(cfg: ServeConfig, toks: list[int]) -> list[int]:
    """Without the BOS the backend's tokenize adds (where the model asks for one)."""
    return toks[1:] if toks and cfg.bos_id is not None and toks[0] == cfg.bos_id else toks


def prompt_tokens(backend: Any, cfg: ServeConfig, prompt: str | list[int | str]
                  ) -> list[int]:
    """Token ids of text, of ids, or of llama-server's mix of ids and strings (the
    strings after the first without BOS, as llama-server)."""
    if isinstance(prompt, str):
        return backend.tokenize(prompt)
    if all(isinstance(x, int) for x in prompt):
        return list(prompt)  # type: ignore[arg-type]
    out: list[int] = []
    for i, x in enumerate(prompt):
        out += [x] if isinstance(x, int) else (
            backend.tokenize(x) if i == 0 else strip_bos(cfg, backend.tokenize(x)))
    return out


def check_ids(cfg: ServeConfig, toks: Sequence[int], param: str) -> None:
    """Refuse an id outside the vocabulary (400 naming ``param``)."""
    bad = next((t for t in toks if not 0 <= t < cfg.n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} out of range [0, {cfg.n_vocab})", param=param)


def budget(cfg: ServeConfig, toks: list[int], n_new: int) -> tuple[int, bool]:
    """(tokens to generate, whether that is the context's end rather than the request's
    n): llama-server stops at the end of the context (truncated) instead of refusing a
    request that asks for more; a prompt that fills it is refused."""
    if not toks:
        raise ApiError(400, "the prompt has no tokens", param="prompt")
    check_ids(cfg, toks, "prompt")
    room = cfg.n_ctx - len(toks)
    if room < 1 and n_new != 0 or room < 0:
        raise ApiError(400, f"the prompt ({len(toks)} tokens) leaves no room in the "
                       f"context of {cfg.n_ctx} tokens; shorten the prompt",
                       type="exceed_context_size_error",
                       extra={"n_prompt_tokens": len(toks), "n_ctx": cfg.n_ctx})
    if n_new == -1 or n_new > room:
        return room, True
    return n_new, False
