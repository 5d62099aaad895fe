"""OpenAI's response shapes for /v1/completions and /v1/chat/completions (`Shape`: the
whole response and a stream's chunks) and their log-probabilities.

Why pure functions of the typed results: the routes and the streams build the same objects
from the same fields, and the shapes are tested without a server."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from mtplib.serve.events import End, RunMetrics, TokenProb
from mtplib.serve.native import timings, token_bytes


def chat_logprobs(entries: list[TokenProb]) -> dict:
    """OpenAI's chat choice.logprobs."""
    return {"content": [{"token": e.token, "logprob": e.logprob,
                         "bytes": token_bytes(e.token),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                           "bytes": token_bytes(t.token)} for t in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenProb], offset: int = 0) -> dict:
    """OpenAI's (legacy) completions choice.logprobs; offsets count from ``offset``."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out}


@dataclass
class Shape:
    """OpenAI's response and chunk objects for /v1/completions or /v1/chat/completions."""

    model: str
    chat: bool
    fingerprint: str = "mtplib"
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, stream: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
            return {"id": f"chatcmpl-{self.id}", "object": obj, "created": self.created,
                    "model": self.model, "system_fingerprint": self.fingerprint}
        return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint}

    def logprobs(self, probs: list[TokenProb] | None, offset: int = 0) -> dict | None:
        if probs is None:
            return None
        return chat_logprobs(probs) if self.chat else completion_logprobs(probs, offset)

    def whole(self, text: str, finish: str, n_prompt: int, out: list[int],
              metrics: RunMetrics, probs: list[TokenProb] | None = None,
              end: End | None = None, index: int = 0) -> dict:
        lp = self.logprobs(probs)
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        body = {**self.head(False), "choices": [choice], "usage": usage(n_prompt, len(out)),
                "timings": timings(metrics, n_prompt, len(out))}
        if end is not None:  # llama-server's: the generation reached the context's end
            body["truncated"] = end.truncated
        return body

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False,
              probs: list[TokenProb] | None = None, offset: int = 0, index: int = 0
              ) -> dict:
        lp = self.logprobs(probs, offset)
        if self.chat:
            # the first chunk: the role, content null (as OpenAI and llama-server send it)
            delta: dict = {"role": "assistant", "content": None} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lp,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp,
                      "finish_reason": finish}
        return {**self.head(True), "choices": [choice]}

    def usage_chunk(self, n_prompt: int, n_out: int) -> dict:
        """stream_options.include_usage's last chunk: no choices, the usage."""
        return {**self.head(True), "choices": [], "usage": usage(n_prompt, n_out)}


def merge_choices(bodies: list[dict], n: int) -> dict:
    """One response for several choices (prompts x ``n``, each body's choice carrying its
    index), as llama-server merges them: the first body with every choice; the usage
    counts each prompt once and every choice's tokens (OpenAI's rule for ``n``)."""
    out = dict(bodies[0])
    out["choices"] = [b["choices"][0] for b in bodies]
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies if b["choices"][0]["index"] % n == 0)
    out["usage"] = usage(prompt, sum(b["usage"]["completion_tokens"] for b in bodies))
    if len(bodies) > 1 and "truncated" in out:
        out["truncated"] = any(b.get("truncated") for b in bodies)
    return out
