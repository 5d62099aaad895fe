"""`mtplib generate`: decode from a trunk, plainly or with MTP speculative decoding."""

from __future__ import annotations

import argparse
import json

from mtplib.commands.common import (
    add_json_arg,
    add_log_args,
    parse_tokens,
    resolve_ctx,
    setup_logging,
)
from mtplib.errors import InputError

#: --ctx when not given, capped by the model's context_length
DEFAULT_CTX = 2048


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import MTPRuntime

    _check_args(a)
    if a.plan:  # ranged: layer ranges on RPC shards (local ones unless --endpoints)

        return _run_ranged(a)
    k = (3 if a.draft is None else a.draft) if a.mtp else 0
    if a.mtp and not 1 <= k <= 8:
        raise InputError(f"--draft must be in 1..8, got {k}")
    sampler = Sampler(temperature=a.temp, top_p=a.top_p, seed=a.seed)
    with MTPRuntime(a.model, a.mtp, k=k, settings=_settings(a), sampler=sampler,
                    trace=a.trace, head=a.head, policy=a.policy) as rt:
        prompt = a.tokens if a.tokens is not None else rt.trunk.tokenize(a.prompt)
        tokens, metrics = rt.generate(prompt, a.n)
        text = rt.trunk.detokenize(tokens) if a.prompt is not None else None
    out = {"tokens": tokens, "metrics": metrics}
    if text is not None:
        out["text"] = text
    if a.json:
        print(json.dumps(out))
        return 0
    print("tokens:", " ".join(map(str, tokens)))
    if text is not None:
        print("text:  ", text)
    m = metrics
    line = f"ttft {m['ttft_s'] or 0:.4f} s, decode {m['decode_tok_s'] or 0:.1f} tok/s"
    if k:
        line += (f", k={k}: accepted {m['accepted']}/{m['drafted']} drafts, per position "
                 + ", ".join("-" if x is None else f"{x:.2f}" for x in m["accepted_per_position"]))
    print(line)
    return 0


def _check_args(a: argparse.Namespace) -> None:
    """Refuse, naming the option, every value upstream would abort on or mtplib would run
    silently wrong with; the same bounds whole-model and ranged (--plan)."""
    import math

    from mtplib.runtime.model import check_threads, max_threads

    if (a.tokens is None) == (a.prompt is None):
        raise InputError("give exactly one of --tokens IDS or --prompt TEXT")
    if a.prompt is not None:
        try:
            a.prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 (surrogateescape)
            raise InputError(f"--prompt is not valid UTF-8 text (undecodable byte at "
                             f"character {e.start}); pass UTF-8, or token ids with --tokens"
                             ) from None
    if a.draft is not None and a.mtp is None:
        raise InputError("--draft needs --mtp SIDECAR (the MTP block drafts)")
    if a.draft is not None and not 1 <= a.draft <= 8:
        raise InputError(f"--draft must be in 1..8, got {a.draft}")
    if a.n < 0:
        raise InputError(f"--n must be >= 0, got {a.n}")
    for opt, v in (("--ctx", a.ctx), ("--batch", a.batch), ("--ubatch", a.ubatch)):
        if v is not None and v < 1:
            raise InputError(f"{opt} must be >= 1, got {v}")
    if a.seed < 0:
        raise InputError(f"--seed must be >= 0, got {a.seed}")
    if not (math.isfinite(a.temp) and a.temp >= 0):
        raise InputError(f"--temp must be a finite number >= 0 (0 = greedy), got {a.temp}")
    if not (math.isfinite(a.top_p) and 0 < a.top_p <= 1):
        raise InputError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.threads is None:
        a.threads = min(2, max_threads())
    check_threads(a.threads, "--threads")
    if a.plan is not None and not a.plan.strip():
        raise InputError("--plan is empty: give layer ranges like 0-1,2-3, or leave --plan "
                         "out to run the whole model")
    if a.endpoints is not None and not a.endpoints.strip():
        raise InputError("--endpoints is empty: give HOST:PORT,... (one per --plan range)")
    if a.endpoints and not a.plan:
        raise InputError("--endpoints needs --plan (which layers each endpoint serves)")
    if (a.wan or a.mtp_placement != "tail") and not a.plan:
        raise InputError("--wan and --mtp-placement need --plan (they describe shards)")
    if a.plan:
        check_threads(a.shard_threads, "--shard-threads")
        # the ranged client reads the trunk's block count before any shard loads it: the
        # file must be one upstream loads (whole-model runs check it in Model)
        from mtplib.model.gguf_header import read_header_fast, require_deepseek4
        from mtplib.model.validate import validate_header

        h = read_header_fast(a.model)
        require_deepseek4(h)
        validate_header(h)
    resolve_ctx(a, DEFAULT_CTX, a.model, a.mtp)


def register(sub) -> None:
    g = sub.add_parser(
        "generate", help="decode tokens, plainly or with MTP speculative decoding",
        description="Decode on upstream llama.cpp. Without --mtp: plain decoding. With --mtp "
        "SIDECAR: the MTP block drafts --draft K tokens per step and the trunk verifies them "
        "in one batch (output identical to plain decoding). Greedy unless --temp > 0 "
        "(sample-and-match with position-keyed randomness: the same tokens with and without "
        "MTP for one --seed).")
    g.add_argument("--model", required=True, help="trunk GGUF")
    g.add_argument("--mtp", metavar="SIDECAR", help="the trunk's mtp- sidecar GGUF: turns MTP on")
    g.add_argument("--draft", type=int, metavar="K", help="draft length with --mtp (default 3)")
    g.add_argument("--tokens", type=parse_tokens, help="prompt as token ids, e.g. 1,2,3")
    g.add_argument("--prompt", help="prompt text (tokenized by the model's tokenizer)")
    g.add_argument("--n", type=int, default=32, help="tokens to generate")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--ctx", type=int, default=None,
                   help=f"context size (default: min({DEFAULT_CTX}, the model's "
                   "context_length)); a value above context_length is refused")
    g.add_argument("--batch", type=int, default=512, help="n_batch (prefill chunk)")
    g.add_argument("--ubatch", type=int, default=512, help="n_ubatch (micro-batch)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads, 1..this machine's CPUs (default 2, or 1 on one CPU)")
    g.add_argument("--kv-type", default="f16", choices=["f16", "f32", "bf16", "q8_0"],
                   help="K/V cache type")
    g.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                   help="flash attention (auto: upstream decides)")
    g.add_argument("--swa-full", default="on", choices=["on", "off"],
                   help="full-size SWA cache (on: the C API's default; llama-server uses off)")
    g.add_argument("--hidden-rows", default="auto", choices=["auto", "api", "captured"],
                   help="source of the trunk's h_nextn rows for MTP: auto checks "
                   "this configuration once and takes upstream's API rows if right, else "
                   "captures them in the eval callback (metrics report which)")
    g.add_argument("--trace", action="store_true",
                   help='add "steps": [{"pos", "drafts", "accepted"}] (one per verify step)')
    g.add_argument("--plan", help="ranged execution: contiguous layer ranges, one per shard, "
                   "e.g. 0-1,2-3 (the last shard also holds the output head); starts local "
                   "shards unless --endpoints; metrics add seam_bytes(_per_token)")
    g.add_argument("--endpoints", help="with --plan: running shards HOST:PORT,... in plan order")
    g.add_argument("--wan", metavar="RTT_MS[:MBIT][,...]",
                   help="with --plan: emulate a WAN in the relay in front of each shard: round "
                   "trip in ms (half each way) and optional Mbit/s cap, one value for every "
                   "shard or one per shard (e.g. 100 or 100:50 or 100,0); metrics add waits "
                   "per step and bytes by class")
    g.add_argument("--mtp-placement", default="tail", choices=["tail", "client"],
                   help="with --plan --mtp: run the MTP block on the tail shard or "
                   "in this process next to the sampler (drafts then cost no shard round trip)")
    g.add_argument("--head", default="upstream", choices=["upstream", "client"],
                   help="where the output head runs: in upstream's graph or here, "
                   "from the trunk's hidden rows (a ranged tail then sends hc*n_embd floats "
                   "per row instead of n_vocab logits, in the same wait)")
    g.add_argument("--shard-threads", type=int, default=1,
                   help="threads per local shard with --plan")
    g.add_argument("--policy", choices=["alpha", "beta"], default=None,
                   help="deployment policy negotiated before MTP runs: alpha refuses --mtp "
                   "(exit 2), beta allows it (default: $MTPLIB_POLICY, else beta); plain "
                   "decoding runs under both")
    add_json_arg(g, '{"tokens": [...], "metrics": {...}}')
    add_log_args(g)
    g.set_defaults(fn=run)


def _settings(a: argparse.Namespace):
    """The context and decoding settings of the arguments (both paths take the same)."""
    from mtplib.runtime.settings import DecodeSettings

    return DecodeSettings(n_ctx=a.ctx, n_batch=a.batch, n_ubatch=a.ubatch, n_threads=a.threads,
                          kv_type=a.kv_type, flash_attn=a.flash_attn,
                          swa_full=a.swa_full == "on", hidden_rows=a.hidden_rows)


def _run_ranged(a) -> int:
    """`mtplib generate --plan PLAN [--endpoints ...]`."""
    import json

    from mtplib.distributed.ranged_mtp import generate_ranged as generate_ranged_mtp
    from mtplib.runtime.rpc import parse_endpoint
    from mtplib.runtime.sampling import Sampler
    from mtplib.runtime.speculative import EngineOptions

    eps = None
    if a.endpoints:
        eps = [e.strip() for e in a.endpoints.split(",") if e.strip()]
        for e in eps:
            parse_endpoint(e)
    k = (3 if a.draft is None else a.draft) if a.mtp else 0
    opts = EngineOptions(k=k, settings=_settings(a), sampler=Sampler(a.temp, a.top_p, a.seed),
                         trace=a.trace, head=a.head)
    prompt = a.tokens if a.tokens is not None else a.prompt
    out = generate_ranged_mtp(a.model, prompt, a.n, plan=a.plan, sidecar=a.mtp, opts=opts,
                              endpoints=eps, shard_threads=a.shard_threads, wan=a.wan,
                              mtp_placement=a.mtp_placement, policy=a.policy)
    if a.json:
        print(json.dumps(out))
        return 0
    m = out["metrics"]
    print("tokens:", " ".join(map(str, out["tokens"])))
    if "text" in out:
        print("text:  ", out["text"])
    print(f"ttft {m['ttft_s'] or 0:.4f} s, decode {m['decode_tok_s'] or 0:.1f} tok/s, "
          f"plan {m['plan']}")
    per = ", ".join(f"{k} {v:.0f}" for k, v in m["seam_bytes_per_token"].items())
    print(f"seam bytes {m['seam_bytes']} (per token: {per}; contract minimum "
          + ", ".join(f"{k} {v}" for k, v in m["seam_contract_min_per_token"].items()) + ")")
    print("waits per step: " + ", ".join(f"{k} {v:.2f}" for k, v in m["waits_per_step"].items())
          + f"; WAN {','.join(m['wan'])} ms; cache bytes crossing shards: "
          f"{m['cache_bytes_crossing']}")
    for v in m["wire_violations"]:
        print("contract violation:", v)
    return 0
