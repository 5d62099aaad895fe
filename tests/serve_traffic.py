"""A seeded mixed-traffic generator for `mtplib serve` (issue 39 item 1): the same seed
replays the same request sequence, in the same bursts, against a running service.

Each burst sends several requests at once: greedy probes (whose tokens are compared with
the same request served alone), streamed and not, sampled requests with seeds,
log-probabilities, ``n_predict: -1`` and huge ``max_tokens``, prompts at the context
limit, bad input, and clients that abandon a request mid-generation (streamed or not).
`reference` serves every probe alone first, with the top-2 log-probabilities of every
position; `run` compares each probe's tokens with it. A probe that parts from its
reference where the reference's greedy choice was a near-tie (top-1 minus top-2 logit below
`NOISE_BOUND`: float noise of another decode shape can flip it) is counted as a near-tie,
any other difference as a mismatch (the project's criterion, `mtplib.lab.quality`).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from mtplib.lab.quality import NOISE_BOUND

#: the probe the red team saw answered wrongly (issue 39 item 1)
RED_TEAM_PROBE = {"path": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "def main("}],
                           "max_tokens": 16, "temperature": 0}}

_WORDS = ("def", "main", "(", ")", "return", "x", "=", "1", "for", "i", "in", "range",
          "print", "if", "else", ":", "class", "import", "self", "value")


@dataclass(frozen=True)
class Req:
    """One request of the sequence: ``kind`` says what the client does with it."""

    kind: str  # probe | stream_probe | sampled | logprobs | long | ctx_limit | bad |
    #            cancel_nonstream | cancel_stream
    path: str
    body: dict
    cancel_after_s: float = 0.0

    @property
    def greedy_probe(self) -> bool:
        return self.kind in ("probe", "stream_probe")

    def key(self) -> str:
        """The request served alone has the same answer: one reference per key."""
        body = {k: v for k, v in self.body.items() if k != "stream"}
        return json.dumps([self.path, body], sort_keys=True)


@dataclass
class Result:
    req: Req
    status: int | None = None
    tokens: list[int] | None = None
    error: str | None = None


@dataclass
class Report:
    """What `run` saw: greedy probes compared, mismatches, statuses by code."""

    compared: int = 0
    mismatches: list[tuple[Req, list[int], list[int]]] = field(default_factory=list)
    #: (request, first differing index, the reference's top-2 margin there)
    near_ties: list[tuple[Req, int, float]] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _probe_pool(n: int) -> list[tuple[str, dict]]:
    """``n`` greedy probes (path, body), the red team's first: a fixed pool, so each is
    served alone once for its reference however long the traffic runs."""
    rng = random.Random(0)
    pool = [(RED_TEAM_PROBE["path"], dict(RED_TEAM_PROBE["body"]))]
    while len(pool) < n:
        m = rng.choice((4, 8, 16, 24))
        if rng.random() < 0.5:
            pool.append(("/v1/chat/completions", {
                "messages": [{"role": "user", "content": _prompt(rng, rng.randint(1, 6))}],
                "max_tokens": m, "temperature": 0}))
        else:
            pool.append(("/v1/completions", {"prompt": _prompt(rng, rng.randint(1, 8)),
                                             "max_tokens": m, "temperature": 0}))
    return pool


PROBES = _probe_pool(48)


def _probe(rng: random.Random, stream: bool) -> Req:
    path, body = PROBES[0] if rng.random() < 0.3 else rng.choice(PROBES)
    return Req("stream_probe" if stream else "probe", path,
               {**body, "return_tokens": True, "stream": stream})


def requests(seed: int, n_ctx: int, probe_share: float = 0.4) -> Iterator[list[Req]]:
    """Bursts of requests, forever, the same for the same seed. ``n_ctx``: a slot's
    context (the context-limit prompts fill it); ``probe_share``: the greedy probes' share,
    the rest spread over the other kinds as with the default 0.4."""
    rng = random.Random(seed)
    while True:
        burst = []
        for _ in range(rng.randint(2, 7)):
            x = rng.random()
            if x < probe_share:
                burst.append(_probe(rng, stream=rng.random() < 0.4))
                continue
            r = 0.4 + 0.6 * (x - probe_share) / (1 - probe_share)  # the others, as at 0.4
            if r < 0.40:
                burst.append(_probe(rng, stream=rng.random() < 0.4))
            elif r < 0.50:
                burst.append(Req("sampled", "/v1/completions",
                                 {"prompt": _prompt(rng, 4), "max_tokens": rng.randint(4, 32),
                                  "temperature": 0.9, "seed": rng.randint(0, 99),
                                  "stream": rng.random() < 0.5}))
            elif r < 0.56:
                burst.append(Req("logprobs", "/completion",
                                 {"prompt": _prompt(rng, 3), "n_predict": 8, "n_probs": 2,
                                  "temperature": 0}))
            elif r < 0.62:
                burst.append(Req("long", "/completion",
                                 {"prompt": _prompt(rng, 2),
                                  "n_predict": rng.choice((-1, 10 ** 6)),
                                  "temperature": 0}, cancel_after_s=rng.uniform(0.3, 1.5)))
            elif r < 0.68:
                burst.append(Req("ctx_limit", "/completion",
                                 {"prompt": [1] * (n_ctx - rng.randint(1, 6)),
                                  "n_predict": 8, "temperature": 0}))
            elif r < 0.74:
                burst.append(Req("bad", "/v1/completions",
                                 rng.choice(({"prompt": "x", "max_tokens": "many"},
                                             {"prompt": [10 ** 9], "max_tokens": 4},
                                             {"prompt": "x", "temperature": -1},
                                             {"prompt": "", "max_tokens": 4}))))
            elif r < 0.88:
                burst.append(Req("cancel_nonstream", "/v1/completions",
                                 {"prompt": _prompt(rng, 3), "max_tokens": 400,
                                  "temperature": 0}, cancel_after_s=rng.uniform(0.05, 1.2)))
            else:
                burst.append(Req("cancel_stream", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": _prompt(rng, 3)}],
                                  "max_tokens": 400, "temperature": 0, "stream": True},
                                 cancel_after_s=rng.uniform(0.05, 1.2)))
        yield burst


def _stream_tokens(lines: list[str]) -> list[int] | None:
    for line in reversed(lines):
        if line.startswith("data: {"):
            obj = json.loads(line[6:])
            if "tokens" in obj:
                return obj["tokens"]
    return None


async def send(client: httpx.AsyncClient, req: Req) -> Result:
    """One request as its client sends it (abandoning it after ``cancel_after_s``)."""
    res = Result(req)

    async def go() -> None:
        if req.body.get("stream"):
            async with client.stream("POST", req.path, json=req.body) as r:
                res.status = r.status_code
                lines = [line async for line in r.aiter_lines()]
                res.tokens = _stream_tokens(lines)
        else:
            r = await client.post(req.path, json=req.body)
            res.status = r.status_code
            if r.status_code == 200:
                res.tokens = r.json().get("tokens")
            else:
                res.error = r.text[:300]

    try:
        if req.cancel_after_s:
            try:
                await asyncio.wait_for(go(), req.cancel_after_s)
            except TimeoutError:
                res.status = None  # abandoned, as intended
        else:
            await go()
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _margins(body: dict) -> list[float | None]:
    """Top-1 minus top-2 log-probability (= logit margin) per generated token of a
    response that asked for two alternatives; None where the two share a text (the legacy
    completions shape keys them by text)."""
    lp = body["choices"][0]["logprobs"]
    if "content" in lp:  # chat: a list per token
        tops = [[t["logprob"] for t in e["top_logprobs"]] for e in lp["content"]]
    else:
        tops = [list(d.values()) for d in lp["top_logprobs"]]
    out: list[float | None] = []
    for v in tops:
        top = sorted(v, reverse=True)
        out.append(top[0] - top[1] if len(top) >= 2 else None)
    return out


async def reference(base_url: str, reqs: list[Req]
                    ) -> dict[str, tuple[list[int], list[float | None]]]:
    """Every distinct greedy probe served alone (one at a time, nothing else running):
    its tokens and the top-2 margin of every generated position."""
    ref: dict[str, tuple[list[int], list[float | None]]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for req in reqs:
            if not req.greedy_probe or req.key() in ref:
                continue
            chat = req.path.endswith("chat/completions")
            extra = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
            r = await client.post(req.path, json={**req.body, **extra, "stream": False})
            assert r.status_code == 200, r.text
            body = r.json()
            ref[req.key()] = (body["tokens"], _margins(body))
    return ref


def classify(got: list[int], want: list[int], margins: list[float | None]
             ) -> tuple[int, float | None] | None:
    """None when equal; else (first differing index, the reference's margin there)."""
    if got == want:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
             min(len(got), len(want)))
    return i, margins[i] if i < len(margins) else None


async def run(base_url: str, seed: int, n_ctx: int, n_bursts: int,
              ref: dict | None = None, gap_s: float = 0.0, probe_share: float = 0.4
              ) -> Report:
    """Replay ``n_bursts`` bursts of the seed's sequence; compare every greedy probe with
    its reference (served alone first when ``ref`` lacks it)."""
    bursts = [b for b, _ in zip(requests(seed, n_ctx, probe_share), range(n_bursts),
                                strict=False)]
    ref = dict(ref or {})
    ref.update(await reference(base_url, [r for b in bursts for r in b
                                          if r.key() not in ref]))
    rep = Report()
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        for burst in bursts:
            results = await asyncio.gather(*(send(client, r) for r in burst))
            for res in results:
                if res.status is not None:
                    rep.statuses[res.status] = rep.statuses.get(res.status, 0) + 1
                if res.error and res.req.kind not in ("bad",) and res.status != 400:
                    rep.errors.append(f"{res.req.kind} {res.status}: {res.error}")
                if res.req.greedy_probe and res.status == 200:
                    want, margins = ref[res.req.key()]
                    rep.compared += 1
                    part = classify(res.tokens or [], want, margins)
                    if part is None:
                        continue
                    i, margin = part
                    if margin is not None and margin < NOISE_BOUND:
                        rep.near_ties.append((res.req, i, margin))
                    else:
                        rep.mismatches.append((res.req, res.tokens or [], want))
            if gap_s:
                await asyncio.sleep(gap_s)
    return rep


def main() -> None:
    """Replay against a running service: ``python tests/serve_traffic.py --url URL``."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bursts", type=int, default=100)
    p.add_argument("--probe-share", type=float, default=0.4)
    a = p.parse_args()
    n_ctx = httpx.get(a.url + "/v1/models").json()["data"][0]["meta"]["n_ctx"]
    t0 = time.monotonic()
    rep = asyncio.run(run(a.url, a.seed, n_ctx, a.bursts, probe_share=a.probe_share))
    print(json.dumps({"seed": a.seed, "bursts": a.bursts, "probe_share": a.probe_share,
                      "compared": rep.compared,
                      "mismatches": len(rep.mismatches), "near_ties": len(rep.near_ties),
                      "near_tie_margins": [m for _, _, m in rep.near_ties],
                      "statuses": rep.statuses, "errors": rep.errors[:5],
                      "seconds": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
