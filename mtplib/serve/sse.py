"""Server-sent events of a running request: OpenAI's chunks (`openai_stream`) and
llama-server's /completion events (`native_stream`), from its jobs' typed events.

Why the error as an event: once the first byte is sent the status is already 200, so a
failure later (a shard lost, the shutdown's cut) is the stream's last event. Several
choices (prompts x ``n``) share one stream, each event naming its choice by ``index``, as
llama-server streams them; llama-server's per-request extras ride on the events it puts
them on: ``timings`` on every event (timings_per_token), ``prompt_progress`` when a
choice's prompt starts and ends processing (return_progress), and with ``n_probs`` one
event per token, its ``completion_probabilities`` that token's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from mtplib.serve.config import ServeConfig
from mtplib.serve.events import Done, Failed, Progress, Started, TokenProb, Tokens
from mtplib.serve.native import native_body, native_probs, pick_fields, progress, timings
from mtplib.serve.openai import Shape
from mtplib.serve.protocol import BaseRequest, NativeRequest
from mtplib.serve.serving import Running

#: the response headers of a stream
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_line(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def _events(running: Running):
    """(index, event) of every choice, the `Started` already seen first, until each
    choice is done or one fails."""
    for i, st in list(running.started.items()):
        yield i, st
    left = {j.index for j in running.jobs}
    while left:
        i, ev = await running.job.events.get()
        if isinstance(ev, Started):
            running.started[i] = ev
        yield i, ev
        if isinstance(ev, Failed):
            return
        if isinstance(ev, Done):
            left.discard(i)


async def openai_stream(running: Running, req: BaseRequest, shape: Shape
                        ) -> AsyncIterator[bytes]:
    """One chunk per step's tokens of each choice, each choice's last with finish_reason
    and timings (and usage, of every choice, when stream_options.include_usage), then
    ``[DONE]``."""
    job = running.job
    want_lp = job.n_logprobs is not None
    n = req.n_choices()
    offsets: dict[int, int] = {}
    used = {"prompt": 0, "out": 0}
    try:
        async for i, ev in _events(running):  # a client that leaves cancels this
            n_prompt = running.started[i].n_prompt if i in running.started else 0
            if isinstance(ev, Started):
                offsets[i] = 0
                if i % n == 0:
                    used["prompt"] += ev.n_prompt
                if shape.chat or job.return_progress:
                    c = shape.chunk(None if shape.chat else "", first=True, index=i)
                    if job.return_progress:
                        c["prompt_progress"] = progress(ev.n_prompt, 0, done=False)
                    yield sse_line(c)
            elif isinstance(ev, Progress):
                c = shape.chunk(None if shape.chat else "", first=True, index=i)
                c["prompt_progress"] = progress(ev.n_prompt, ev.time_ms, done=True)
                yield sse_line(c)
            elif isinstance(ev, Tokens):
                if ev.text or (want_lp and ev.probs) or ev.timings is not None:
                    c = shape.chunk(ev.text, probs=ev.probs if want_lp else None,
                                    offset=offsets[i], index=i)
                    if ev.timings is not None:
                        c["timings"] = timings(ev.timings, n_prompt, ev.n_out)
                    yield sse_line(c)
                    offsets[i] += len(ev.text)
            elif isinstance(ev, Failed):
                yield sse_line(ev.error.body())
                return
            elif isinstance(ev, Done):
                used["out"] += len(ev.tokens)
                last = shape.chunk(None if shape.chat else "", ev.finish, index=i)
                last["timings"] = timings(ev.metrics, n_prompt, len(ev.tokens))
                last["truncated"] = ev.end.truncated
                if req.return_tokens:
                    last["tokens"] = ev.tokens
                yield sse_line(last)
        if req.include_usage():
            yield sse_line(shape.usage_chunk(used["prompt"], used["out"]))
        yield sse_line("[DONE]")
    finally:
        running.cancel()  # the client left (or we are done): stop at the next step


def per_token(ev: Tokens) -> list[tuple[list[int], str, list[TokenProb]]]:
    """An event's tokens one by one, each with its text and record, as llama-server
    streams under n_probs: a token's text is its piece while the event's text goes on with
    it; from the first that does not (a stop string held back, a character split between
    tokens) the rest of the text goes with the last token."""
    if not ev.tokens or len(ev.probs) != len(ev.tokens):
        return [(ev.tokens, ev.text, ev.probs)]
    out, at, aligned = [], 0, True
    last = len(ev.tokens) - 1
    for k, (t, p) in enumerate(zip(ev.tokens, ev.probs, strict=True)):
        aligned = aligned and k < last and ev.text.startswith(p.token, at)
        if k == last:
            take = ev.text[at:]
        else:
            take = p.token if aligned else ""
        at += len(take)
        out.append(([t], take, [p]))
    return out


async def native_stream(cfg: ServeConfig, running: Running, req: NativeRequest
                        ) -> AsyncIterator[bytes]:
    """llama-server's /completion stream: content, tokens and stop per event, each
    choice's last with everything (no [DONE])."""
    job = running.job
    settings = {j.index: j.settings for j in running.jobs}
    post = req.post_sampling_probs
    sent: dict[int, int] = {}
    try:
        async for i, ev in _events(running):
            n_prompt = running.started[i].n_prompt if i in running.started else 0
            head = {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": 0,
                    "tokens_predicted": sent.get(i, 0), "tokens_evaluated": n_prompt}
            if isinstance(ev, Started):
                sent[i] = 0
                if job.return_progress:
                    yield sse_line({**head, "prompt_progress": progress(
                        ev.n_prompt, 0, done=False)})
            elif isinstance(ev, Progress):
                yield sse_line({**head, "prompt_progress": progress(
                    ev.n_prompt, ev.time_ms, done=True)})
            elif isinstance(ev, Tokens):
                parts = per_token(ev) if job.n_logprobs is not None else [
                    (ev.tokens, ev.text, ev.probs)]
                for toks, text, probs in parts:
                    sent[i] += len(toks)
                    ch = {**head, "content": text, "tokens": toks,
                          "tokens_predicted": sent[i]}
                    if ev.timings is not None:
                        ch["timings"] = timings(ev.timings, n_prompt, ev.n_out)
                    if job.n_logprobs is not None and probs:
                        ch["completion_probabilities"] = native_probs(probs, post)
                    yield sse_line(ch)
            elif isinstance(ev, Failed):
                yield sse_line(ev.error.body())
                return
            elif isinstance(ev, Done):
                body = native_body(cfg, settings[i], req.return_tokens, "", ev.tokens,
                                   ev.metrics, ev.end, n_prompt,
                                   running.started[i].prompt_text, None, index=i)
                body["tokens"] = []
                yield sse_line(pick_fields(body, req.response_fields))
    finally:
        running.cancel()
