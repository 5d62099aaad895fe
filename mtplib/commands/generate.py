"""`mtplib generate`: decode from a trunk (MTP off: plain greedy)."""

from __future__ import annotations

import argparse
import json

from mtplib.commands.common import add_log_args, parse_tokens, setup_logging


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    from mtplib.runtime.generate import greedy
    from mtplib.runtime.model import Context, ContextConfig, Model

    if (a.tokens is None) == (a.prompt is None):
        raise ValueError("give exactly one of --tokens IDS or --prompt TEXT")
    with Model(a.model) as model:
        prompt = a.tokens if a.tokens is not None else model.tokenize(a.prompt)
        cfg = ContextConfig(n_ctx=a.ctx, n_batch=a.batch, n_ubatch=a.ubatch,
                            n_threads=a.threads, kv_type=a.kv_type, flash_attn=a.flash_attn)
        with Context(model, cfg) as ctx:
            gen = greedy(ctx, prompt, a.n)
    out = gen.to_json()
    if a.json:
        print(json.dumps(out))
    else:
        m = out["metrics"]
        print("tokens:", " ".join(map(str, gen.tokens)))
        print(f"ttft {m['ttft_s']:.4f} s, decode {m['decode_tok_s'] or 0:.1f} tok/s")
    return 0


def register(sub) -> None:
    g = sub.add_parser("generate", help="decode tokens from a model",
                       description="Greedy decoding on upstream llama.cpp. Prints tokens and "
                       "metrics (TTFT, decode tok/s); --json for machine-readable output.")
    g.add_argument("--model", required=True, help="trunk GGUF")
    g.add_argument("--tokens", type=parse_tokens, help="prompt as token ids, e.g. 1,2,3")
    g.add_argument("--prompt", help="prompt text (tokenized by the model's tokenizer)")
    g.add_argument("--n", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--ctx", type=int, default=2048, help="context size (default 2048)")
    g.add_argument("--batch", type=int, default=512, help="n_batch (prefill chunk)")
    g.add_argument("--ubatch", type=int, default=512, help="n_ubatch")
    g.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    g.add_argument("--kv-type", default="f16", choices=["f16", "f32", "bf16", "q8_0"])
    g.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_log_args(g)
    g.set_defaults(fn=run)
