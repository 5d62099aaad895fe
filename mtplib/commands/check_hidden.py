"""`mtplib check-hidden`: are upstream's h_nextn rows right for this context configuration?

Decodes on throwaway contexts and compares the rows `llama_get_embeddings_nextn` returns
with the `h_nextn` tensor captured through the eval callback; the captured rows are
checked against the logits through the trunk's head recomputed in numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mtplib.commands.common import (
    add_json_arg,
    add_log_args,
    comma_list,
    resolve_ctx,
    setup_logging,
)
from mtplib.errors import InputError
from mtplib.files import write_json
from mtplib.runtime.settings import FLASH_ATTN_MODES, KV_TYPE_NAMES, DecodeSettings

if TYPE_CHECKING:  # the CLI loads the ctypes runtime only when a command runs
    from mtplib.runtime.model import ContextConfig

#: --ctx when not given, capped by the model's context_length
DEFAULT_CTX = 512
SUMMARY_KEYS = ("api_rows_ok", "bad_rows", "n_rows", "max_abs_diff", "capture_ok",
                "capture_logits_max_diff", "api_logits_max_diff", "reserve_fix_ok")


def _csv(kind):
    def parse(s: str):
        try:
            return tuple(kind(x) for x in comma_list(s, "the list", "values like a,b"))
        except InputError as e:  # an empty element
            raise argparse.ArgumentTypeError(str(e)) from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated values: {s!r}") from None
    return parse


def _bools(s: str) -> tuple[bool, ...]:
    vals = {"masked": True, "unmasked": False, "1": True, "0": False}
    try:
        return tuple(vals[x] for x in comma_list(s, "--matrix-masked", "masked,unmasked"))
    except InputError as e:  # an empty element
        raise argparse.ArgumentTypeError(str(e)) from None
    except KeyError:
        raise argparse.ArgumentTypeError("--matrix-masked takes masked,unmasked") from None


def _cfg(a: argparse.Namespace) -> ContextConfig:
    """The checked context: the arguments' DecodeSettings plus the rollback depth."""
    from mtplib.runtime.model import ContextConfig

    s = DecodeSettings(n_ctx=a.ctx, n_batch=a.batch, n_ubatch=a.ubatch, n_threads=a.threads,
                       kv_type=a.kv_type, flash_attn=a.flash_attn, swa_full=a.swa_full == "on")
    return ContextConfig.from_settings(s, n_rs_seq=a.rs)


def _print_table(rows: list[dict]) -> None:
    print(f"{'n_ctx':>5} {'kv':4} {'fa':5} {'ubatch':>6} {'rows':8} {'tokens':>6} {'bad/rows':>10} "
          f"{'max|diff|':>9} {'capture':7} {'fix':5} mode")
    for r in rows:
        print(f"{r['n_ctx']:>5} {r['kv_type']:4} {r['flash_attn']:5} {r['n_ubatch']:>6} "
              f"{'masked' if r['masked'] else 'all':8} {r['n_tokens']:>6} "
              f"{r['bad_rows']:>4}/{r['n_rows']:<5} {r['max_abs_diff']:>9.3g} "
              f"{'ok' if r['capture_ok'] else 'FAIL':7} {str(r['reserve_fix_ok']):5} "
              f"{r['mode']}")


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    if a.threads is None:
        a.threads = 1 if a.matrix else 2
    from mtplib import pins
    from mtplib.model.gguf_header import read_header, require_deepseek4
    from mtplib.runtime import hidden_check
    from mtplib.runtime.row_source import choose_row_source
    from mtplib.stamps import sha256_file

    require_deepseek4(read_header(a.model))  # bad paths: one line, exit 2
    if a.matrix:
        t0 = time.perf_counter()
        kw = {k: v for k, v in (("kv_types", a.matrix_kv), ("flash_attn", a.matrix_fa),
                                ("ubatches", a.matrix_ubatch), ("masked", a.matrix_masked),
                                ("prompt_lengths", a.matrix_tokens),
                                ("n_ctxs", a.matrix_ctx)) if v}
        progress = None if a.json else (lambda r: print(
            f"  ctx={r['n_ctx']} {r['kv_type']} fa={r['flash_attn']} ub={r['n_ubatch']} "
            f"{'masked' if r['masked'] else 'all'} n={r['n_tokens']}: "
            f"{r['bad_rows']}/{r['n_rows']} bad", file=sys.stderr))
        rows = hidden_check.hidden_matrix(a.model, n_batch=a.batch, n_threads=a.threads,
                                          progress=progress, **kw)
        out = {
            "command": "mtplib " + shlex.join(sys.argv[1:]),
            "model": {"path": str(a.model), "sha256": sha256_file(Path(a.model))},
            "pins": pins.as_dict(),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpu_count": os.cpu_count(), "threads": a.threads},
            "followups": [list(f) for f in hidden_check.FOLLOWUPS],
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "n_configs": len(rows),
            "n_affected": sum(not r["api_rows_ok"] for r in rows),
            "rows": rows,
        }
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            write_json(a.out, out, indent=1)
        if a.json:
            print(json.dumps(out))
        else:
            _print_table(rows)
            print(f"{out['n_affected']}/{out['n_configs']} configurations return wrong rows "
                  f"({out['elapsed_s']} s)" + (f"; written to {a.out}" if a.out else ""))
        return 0

    resolve_ctx(a, DEFAULT_CTX, a.model)
    cfg = _cfg(a)
    if a.cost:
        res = hidden_check.capture_cost(a.model, cfg, n_prompt=a.tokens or 32,
                                        n_decode=a.cost_decode, repeats=a.cost_repeats)
        print(json.dumps(res) if a.json else
              f"decode {res['decode_tok_s_api']:.1f} tok/s (API rows) vs "
              f"{res['decode_tok_s_captured']:.1f} tok/s (captured rows): "
              f"{res['decode_overhead_pct']:.0f}% slower with capture "
              f"(+{res['decode_overhead_ms']:.2f} ms per decode)")
        return 0
    if a.decide:
        d = choose_row_source(
            a.model, replace(cfg, nextn_rows="masked" if a.masked else "all"),
            n_tokens=a.tokens, reserve=a.reserve)
        report = {"mode": d.mode, "reason": d.reason, **d.report}
    else:
        report = hidden_check.check_hidden(a.model, cfg, a.tokens or 7, a.masked,
                                           reserve=a.reserve)
    if a.json:
        print(json.dumps(report))
    else:
        for k in (("mode", "reason") if a.decide else ()) + SUMMARY_KEYS:
            print(f"{k}: {report.get(k)}")
        c = report.get("config", {})
        print("config: " + ", ".join(f"{k}={v}" for k, v in c.items() if k != "followups"))
    return 0 if report.get("api_rows_ok") else 1


def register(sub) -> None:
    p = sub.add_parser(
        "check-hidden", help="check upstream's h_nextn rows for a context configuration",
        description="Decode on throwaway contexts and compare the rows "
        "llama_get_embeddings_nextn returns with the h_nextn tensor captured through the "
        "eval callback (itself checked against the logits through the trunk's head). "
        "Exit 0: API rows right; 1: API rows wrong or unverifiable (report printed); "
        "2: bad input. --matrix runs a configuration matrix instead (exit 0).")
    p.add_argument("model", help="trunk GGUF")
    p.add_argument("--tokens", type=int, default=None,
                   help="prompt length (default 7; with --decide: about 3 ubatches; "
                   "with --cost: 32)")
    p.add_argument("--masked", action="store_true", help="masked nextn rows (output rows only)")
    p.add_argument("--ctx", type=int, default=None,
                   help=f"context size (default: min({DEFAULT_CTX}, the model's "
                   "context_length)); a value above context_length is refused")
    p.add_argument("--batch", type=int, default=512, help="n_batch")
    p.add_argument("--ubatch", type=int, default=512, help="n_ubatch (micro-batch)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default 2; 1 with --matrix: ggml's spinning worker "
                   "threads make a busy 2-core machine many times slower)")
    p.add_argument("--kv-type", default="f16", choices=KV_TYPE_NAMES, help="K/V cache type")
    p.add_argument("--flash-attn", default="auto", choices=FLASH_ATTN_MODES,
                   help="flash attention (auto: upstream decides)")
    p.add_argument("--swa-full", default="on", choices=["on", "off"],
                   help="full-size SWA cache (on: the C API's default, mtplib's; off: what "
                   "upstream's llama-server and llama-cli use)")
    p.add_argument("--rs", type=int, default=0, help="n_rs_seq (tail-rollback depth)")
    add_json_arg(p, "the report")
    p.add_argument("--reserve", action="store_true",
                   help="apply the reserve workaround (force_reserve) to every context")
    p.add_argument("--decide", action="store_true",
                   help="print the row source the MTP loop would use (api|captured|unsupported)")
    p.add_argument("--cost", action="store_true",
                   help="measure decode tok/s with API rows vs captured rows instead")
    p.add_argument("--cost-decode", type=int, default=256, help="decodes per --cost run")
    p.add_argument("--cost-repeats", type=int, default=7, help="--cost runs per path")
    m = p.add_argument_group("matrix")
    m.add_argument("--matrix", action="store_true",
                   help="kv type x flash attention x n_ubatch x masked x prompt length")
    m.add_argument("--out", help="write the matrix JSON here")
    m.add_argument("--matrix-kv", type=_csv(str), help="e.g. f16,f32")
    m.add_argument("--matrix-fa", type=_csv(str), help="e.g. on,off,auto")
    m.add_argument("--matrix-ubatch", type=_csv(int), help="e.g. 7,64,512")
    m.add_argument("--matrix-masked", type=_bools, help="masked,unmasked")
    m.add_argument("--matrix-tokens", type=_csv(int), help="prompt lengths, e.g. 7,300")
    m.add_argument("--matrix-ctx", type=_csv(int), help="n_ctx values, e.g. 512,1024,2048")
    add_log_args(p)
    p.set_defaults(fn=run)
