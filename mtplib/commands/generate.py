"""`mtplib generate`: decode from a trunk, plainly or with MTP speculative decoding.

The model, decoding, MTP and ranged options are registered by `add_engine_args`, checked by
`check_engine_args` and turned into a loaded backend by `open_backend`: `mtplib serve`
builds on the same three, so no setting is defined twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Iterator

from mtplib.commands.common import (
    add_json_arg,
    add_log_args,
    add_option,
    add_tls_args,
    comma_list,
    parse_tokens,
    resolve_ctx,
    setup_logging,
    tls_from_args,
)
from mtplib.contract.labels import PLACEMENT_CHOICES, SEAM_CHOICES
from mtplib.contract.types import DEFAULT_DRAFT, DRAFT_BOUNDS, DraftSpec
from mtplib.distributed.results import RangedMetrics
from mtplib.errors import InputError, MtplibError
from mtplib.runtime.request import DEFAULT_CTX as REQUEST_DEFAULT_CTX
from mtplib.runtime.request import DEFAULT_SEAM
from mtplib.runtime.results import GenerationMetrics
from mtplib.runtime.settings import FLASH_ATTN_MODES, KV_TYPE_NAMES, ROW_SOURCES

#: --ctx when not given, capped by the model's context_length (the runtime's one default)
DEFAULT_CTX = REQUEST_DEFAULT_CTX
#: exit code of a ranged run that finished but moved cache state across a shard connection
EXIT_CONTRACT = 3


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    _check_args(a)  # builds the run's request (a.request), checked once
    with open_backend(a) as backend:
        prompt = a.tokens if a.tokens is not None else backend.tokenize(a.prompt)
        tokens, metrics = backend.generate(prompt, a.n)
        text = backend.detokenize(tokens) if a.prompt is not None else None
    ranged = isinstance(metrics, RangedMetrics)
    if a.json:
        out = {"tokens": tokens, "metrics": metrics.to_dict()}
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
    else:
        _print_result(a, tokens, text, metrics)
    return EXIT_CONTRACT if ranged and metrics.wire_violations else 0


def _print_result(a: argparse.Namespace, tokens: list[int], text: str | None,
                  m: GenerationMetrics) -> None:
    """The human-readable result: tokens, text, speed and MTP counts; ranged adds the
    seam and wire accounting."""
    k = draft_k(a)
    print("tokens:", " ".join(map(str, tokens)))
    if text is not None:
        print("text:  ", text)
    line = f"ttft {m.ttft_s or 0:.4f} s, decode {m.decode_tok_s or 0:.1f} tok/s"
    if k:
        line += (f", k={k}: accepted {m.accepted}/{m.drafted} drafts, per position "
                 + ", ".join("-" if x is None else f"{x:.2f}" for x in m.accepted_per_position))
    if not isinstance(m, RangedMetrics):
        print(line)
        return
    print(line + f", plan {m.plan}")
    per = ", ".join(f"{k} {v:.0f}" for k, v in m.seam_bytes_per_token.items())
    print(f"seam bytes {m.seam_bytes} (per token: {per}; contract minimum "
          + ", ".join(f"{k} {v}" for k, v in m.seam_contract_min_per_token.items()) + ")")
    print("waits per step: " + ", ".join(f"{k} {v:.2f}" for k, v in m.waits_per_step.items())
          + f"; WAN {','.join(m.wan)} ms; cache bytes crossing shards: "
          f"{m.cache_bytes_crossing}")
    for v in m.wire_violations:
        print("contract violation:", v)


def draft_spec(a: argparse.Namespace) -> DraftSpec:
    """The drafting the (checked) arguments ask for: MTP off without --mtp, else --draft
    (default DEFAULT_DRAFT). Checked arguments carry it in their request
    (`check_engine_args` builds it: the run's one draft-length check); others are asked
    here."""
    req = getattr(a, "request", None)
    return req.draft if req is not None else DraftSpec.requested(a.draft, mtp=bool(a.mtp))


def draft_k(a: argparse.Namespace) -> int:
    """The draft length the arguments ask for: 0 without --mtp, else --draft."""
    return draft_spec(a).k


def _check_args(a: argparse.Namespace) -> None:
    """generate's own arguments (the prompt), then every engine option."""
    if (a.tokens is None) == (a.prompt is None):
        raise InputError("give exactly one of --tokens IDS or --prompt TEXT")
    if isinstance(a.tokens, str):  # here, not as an argparse type: one line like the rest
        a.tokens = parse_tokens(a.tokens)
    if a.prompt is not None:
        try:
            a.prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 (surrogateescape)
            raise InputError(f"--prompt is not valid UTF-8 text (undecodable byte at "
                             f"character {e.start}); pass UTF-8, or token ids with --tokens"
                             ) from None
    a.grammar_spec = grammar_from_args(a)  # parsed now, before any model loads
    check_engine_args(a)


def check_engine_args(a: argparse.Namespace) -> None:
    """Refuse, naming the option, every value upstream would abort on or mtplib would run
    silently wrong with; the same bounds whole-model and ranged (--plan), for generate and
    serve. Resolves --threads and --ctx in place, then builds the run's request
    (``a.request``: `build_request`, every setting checked once; the backend and
    everything after it read it and check nothing of it again)."""
    import math

    from mtplib.runtime.model import check_threads, max_threads

    if a.draft is not None and a.mtp is None:
        raise InputError("--draft needs --mtp SIDECAR (the MTP block drafts)")
    if a.draft == 0:  # --mtp and --draft 0 contradict: MTP off is leaving --mtp out
        raise InputError(f"--draft must be in {DRAFT_BOUNDS}, got 0")
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
        # shards this process starts share its cores: a second client thread only spins
        # against them (ggml's barrier), so the client gets one; otherwise up to two
        a.threads = 1 if a.plan and not a.endpoints else min(2, max_threads())
    check_threads(a.threads, "--threads")
    if a.endpoints is not None and not a.endpoints.strip():
        raise InputError("--endpoints is empty: give HOST:PORT,... (one per --plan range)")
    if a.endpoints and not a.plan:
        raise InputError("--endpoints/--rpc needs --plan (which layers each endpoint serves; "
                         "mtplib does not split the layers by itself)")
    if not a.plan and (a.wan or a.mtp_placement != "auto" or a.allow_cache_crossing
                       or a.tls or a.insecure_plaintext
                       or getattr(a, "seam", DEFAULT_SEAM) != DEFAULT_SEAM
                       or getattr(a, "peer_wan", None)):
        raise InputError("--wan, --peer-wan, --mtp-placement, --allow-cache-crossing, --tls, "
                         "--insecure-plaintext and --seam need --plan (they describe shards)")
    if getattr(a, "draft_p_min", None) is not None and a.mtp is None:
        raise InputError("--draft-p-min needs -md/--mtp DSPARK (a DSpark draft's confidence "
                         "head)")
    resolve_llama_args(a)
    resolve_ctx(a, DEFAULT_CTX, a.model, a.mtp)
    a.request = request_from_args(a)
    check_spec_type(a)
    note_draft_min(a)


#: how the request's errors name its fields on the command line
CLI_NAMES = {"draft": "--draft", "plan": "--plan", "endpoints": "--endpoints",
             "wan": "--wan", "mtp_placement": "--mtp-placement",
             "shard_threads": "--shard-threads", "tls": "--tls",
             "insecure_plaintext": "--insecure-plaintext",
             "allow_cache_crossing": "--allow-cache-crossing", "seam": "--seam",
             "peer_wan": "--peer-wan"}


def request_from_args(a: argparse.Namespace):
    """The run's `RunRequest` from the (checked) arguments: `build_request`, the one place
    the draft length, "no sidecar means k=0", the policy, the files, the plan, the
    endpoints, the WAN links and TLS are checked. A policy that refuses MTP is refused
    here, before any model loads or shard starts."""
    from mtplib.runtime.request import DraftRefused, build_request
    from mtplib.runtime.sampling import Sampler

    try:
        return build_request(
            a.model, sidecar=a.mtp, draft=a.draft, settings=settings(a),
            sampler=Sampler(temperature=a.temp, top_p=a.top_p, seed=a.seed,
                            grammar=getattr(a, "grammar_spec", None)),
            trace=bool(getattr(a, "trace", False)), head=a.head,
            n_seq_max=int(getattr(a, "parallel", 1)),  # serve's slots
            plan=a.plan, endpoints=endpoints(a), wan=a.wan,
            mtp_placement=a.mtp_placement, shard_threads=a.shard_threads,
            tls=tls_from_args(a), insecure_plaintext=a.insecure_plaintext,
            allow_cache_crossing=a.allow_cache_crossing, seam=getattr(a, "seam", DEFAULT_SEAM),
            peer_wan=getattr(a, "peer_wan", None), policy=a.policy, names=CLI_NAMES,
            p_min=getattr(a, "draft_p_min", None) or 0.0)
    except DraftRefused:  # --mtp is given: 0 is no choice here (leave --mtp out)
        raise InputError(f"--draft must be in {DRAFT_BOUNDS}, got {a.draft}") from None


def endpoints(a: argparse.Namespace) -> list[str] | None:
    """--endpoints as a list (None: local shards are started)."""
    if not a.endpoints:
        return None
    return comma_list(a.endpoints, "--endpoints", "HOST:PORT,... (one per --plan range)")


def add_sampling_args(g: argparse.ArgumentParser) -> None:
    """How many tokens and how they are chosen: generate's request; for serve, the
    defaults of a request that leaves them out."""
    add_option(g, "--n", type=int, default=32, metavar="N",
               help="tokens to generate (serve: when a request gives no max_tokens)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")


#: generate's structured-output options (llama.cpp's spellings), by dest
GRAMMAR_OPTIONS = {"grammar": "--grammar", "grammar_file": "--grammar-file",
                   "json_schema": "--json-schema", "json_schema_file": "--json-schema-file"}


def add_grammar_args(g: argparse.ArgumentParser) -> None:
    """Structured output, as llama.cpp's common arguments spell it: the target's sampling
    is constrained to a GBNF grammar or a JSON schema's language (MTP drafts the grammar
    forbids end the draft; greedy output equals MTP off's under the same grammar)."""
    h = g.add_argument_group("structured output (llama.cpp's options; one of them)")
    h.add_argument("--grammar", metavar="GBNF", default=None,
                   help="constrain the output to this GBNF grammar (root rule: root)")
    h.add_argument("--grammar-file", metavar="FILE", default=None,
                   help="read the GBNF grammar from FILE")
    h.add_argument("-j", "--json-schema", metavar="SCHEMA", default=None,
                   help='constrain the output to a JSON schema\'s language, e.g. '
                   '\'{"type": "object"}\' for any JSON object (converted to GBNF by '
                   "llama-cpp-python's port of upstream's json-schema-to-grammar)")
    h.add_argument("-jf", "--json-schema-file", metavar="FILE", default=None,
                   help="read the JSON schema from FILE")


def grammar_from_args(a: argparse.Namespace):
    """The `GrammarSpec` the structured-output options ask for (None: none), parsed by
    upstream's grammar parser now: a bad grammar or schema is one line before any model
    loads."""
    from mtplib.runtime.grammar import check_grammar
    from mtplib.runtime.structured import grammar_spec, read_text, schema_spec

    given = [opt for dest, opt in GRAMMAR_OPTIONS.items()
             if getattr(a, dest, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give one of {', '.join(GRAMMAR_OPTIONS.values())}, not "
                         f"{' and '.join(given)}")
    if a.grammar is not None:
        spec = grammar_spec(a.grammar, what="--grammar")
    elif a.grammar_file is not None:
        spec = grammar_spec(read_text(a.grammar_file, "--grammar-file"),
                            what="--grammar-file")
    elif a.json_schema is not None:
        spec = schema_spec(a.json_schema, what="--json-schema")
    else:
        spec = schema_spec(read_text(a.json_schema_file, "--json-schema-file"),
                           what="--json-schema-file")
    check_grammar(spec)
    return spec


def add_engine_args(g: argparse.ArgumentParser) -> None:
    """The model, context, MTP and ranged options (one definition for generate and serve);
    `check_engine_args` checks them and `open_backend` loads what they describe."""
    add_option(g, "--model", required=True, metavar="TRUNK", help="trunk GGUF")
    add_option(g, "--mtp", metavar="SIDECAR",
               help="the drafter GGUF, recognised from the file: the trunk's mtp- sidecar "
               "(MTP) or a DSpark draft (arch dflash + markov_w1, whole model only)")
    add_option(g, "--draft", type=int, metavar="K",
               help=f"draft length with --mtp (default {DEFAULT_DRAFT}; a DSpark draft: its "
               "block size, and a longer K is clamped to it as upstream does)")
    add_option(g, "--draft-p-min", type=float, default=None, metavar="P",
               help="DSpark only: stop a draft at the first block slot whose confidence is "
               "below P, in [0, 1] (default 0: the confidence head is unused)")
    add_option(g, "--ctx", type=int, default=None, metavar="N",
               help=f"context size (default: min({DEFAULT_CTX}, the model's "
               "context_length)); a value above context_length is refused")
    add_option(g, "--batch", type=int, default=512, metavar="N", help="n_batch (prefill chunk)")
    add_option(g, "--ubatch", type=int, default=512, metavar="N",
               help="n_ubatch (micro-batch)")
    add_option(g, "--threads", type=int, default=None, metavar="N",
               help="CPU threads, 1..this machine's CPUs (default 2, or 1 on one CPU; 1 "
               "with --plan and no --endpoints: the local shards share these cores)")
    g.add_argument("--kv-type", default="f16", choices=list(KV_TYPE_NAMES),
                   help="K/V cache type")
    add_option(g, "--flash-attn", default="auto", choices=list(FLASH_ATTN_MODES),
                   help="flash attention (auto: upstream decides)")
    g.add_argument("--swa-full", default="on", choices=["on", "off"], nargs="?", const="on",
                   help="full-size SWA cache (on: the C API's default; llama-server uses off); "
                   "bare --swa-full is on, as llama.cpp spells it")
    g.add_argument("--hidden-rows", default="auto", choices=list(ROW_SOURCES),
                   help="source of the trunk's h_nextn rows for MTP: auto checks "
                   "this configuration once and takes upstream's API rows if right, else "
                   "captures them in the eval callback (metrics report which)")
    g.add_argument("--plan", help="ranged execution: contiguous layer ranges, one per shard, "
                   "e.g. 0-1,2-3 (the last shard also holds the output head); starts local "
                   "shards unless --endpoints; metrics add seam_bytes(_per_token)")
    add_option(g, "--endpoints", help="with --plan: running shards HOST:PORT,... in plan "
               "order (llama.cpp's --rpc: the layers still go where --plan says)")
    g.add_argument("--wan", metavar="RTT_MS[:MBIT][,...]",
                   help="with --plan: emulate a WAN in the relay in front of each shard: round "
                   "trip in ms (half each way) and optional Mbit/s cap, one value for every "
                   "shard or one per shard (e.g. 100 or 100:50 or 100,0); metrics add waits "
                   "per step and bytes by class")
    g.add_argument("--mtp-placement", default="auto", choices=PLACEMENT_CHOICES,
                   help="with --plan --mtp: run the MTP block on the tail shard or "
                   "in this process next to the sampler (drafts then cost no shard round "
                   "trip); auto = decided from costs measured at load (the drafter and head "
                   "timed here, the tail link's round trip): the client unless the tail "
                   "drafts a token faster; decision and inputs in metrics.routing.placement")
    g.add_argument("--head", default="auto", choices=["auto", "upstream", "client"],
                   help="where the output head runs: in upstream's graph or here, "
                   "from the trunk's hidden rows (a ranged tail then sends hc*n_embd floats "
                   "per row instead of n_vocab logits, in the same wait); auto = with --plan "
                   "decided from the head's time measured at load (ties: client for ranged "
                   "MTP, upstream otherwise), else upstream")
    g.add_argument("--allow-cache-crossing", action="store_true",
                   help="with --plan: run even where V4 cache state would cross a shard "
                   "connection (the stock build with MTP on); refused by default, and a run "
                   "that moved cache bytes exits 3")
    g.add_argument("--shard-threads", type=int, default=1,
                   help="threads per local shard with --plan")
    g.add_argument("--seam", default=DEFAULT_SEAM, choices=SEAM_CHOICES,
                   help="with --plan: how boundary values reach the next shard: star = "
                   "through this process (it waits once per shard and step), ring = shard to "
                   "shard (patches/0007, RPC 7.2: one wait per step; a shard pair with an "
                   "older shard stays on the star), auto = the ring where this build and "
                   "every shard speak RPC 7.2 and, under --tls, every shard gateway carries "
                   "peer links, else the star; metrics.seam says which ran and why, per "
                   "shard pair (pairs)")
    g.add_argument("--peer-wan", metavar="RTT_MS[:MBIT][,...]",
                   help="with --plan and the ring: emulate the WAN of the shard-to-shard links "
                   "apart from --wan (e.g. --wan 100 --peer-wan 10: the client far, the "
                   "shards near each other), one value for every link or one per link "
                   "(shard i -> i+1); default: a peer link gets the longer of its two "
                   "shards' --wan links (--wan 100,0: the tail's peer link 100); local or "
                   "loopback shards only; metrics.seam.peer_wan")
    add_tls_args(g)  # mutual TLS to the shards (--tls DIR), passed on by open_backend
    g.add_argument("--policy", choices=["alpha", "beta"], default=None,
                   help="deployment policy negotiated before MTP runs: alpha refuses --mtp "
                   "(exit 2), beta allows it (default: $MTPLIB_POLICY, else beta); plain "
                   "decoding runs under both")
    add_llama_args(g)


def add_llama_args(g: argparse.ArgumentParser) -> None:
    """llama.cpp options that have no setting of their own in mtplib: each is taken, then
    `resolve_llama_args` maps it onto mtplib's (-ctk/-ctv onto --kv-type), says in one line
    that it changes nothing here (-ngl, --draft-min), or refuses it naming mtplib's
    equivalent; argparse never reads one as a short option plus a value."""
    h = g.add_argument_group("llama.cpp's spellings without an mtplib setting of their own")
    h.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers",
                   metavar="N", help="accepted with a one-line note: the whole model loads "
                   "with upstream's default placement (a CPU build: every layer on the CPU), "
                   "a ranged one where --plan puts it; a shard serves a GPU with `mtplib "
                   "shard serve --device gpu`")
    for short, long, which in (("-ctk", "--cache-type-k", "K"), ("-ctv", "--cache-type-v",
                                                                    "V")):
        h.add_argument(short, long, dest=long[2:].replace("-", "_"),
                       choices=list(KV_TYPE_NAMES), help=f"the {which} cache type: mtplib's "
                       "K and V share one type (--kv-type), so -ctk and -ctv must agree "
                       "(each defaults to f16, as in llama.cpp)")
    h.add_argument("-tb", "--threads-batch", type=int, dest="threads_batch", metavar="N",
                   help="prompt threads: mtplib uses --threads for prompt and generation, "
                   "so only the same value is accepted")
    h.add_argument("--draft-min", "--draft-n-min", "--spec-draft-n-min", type=int,
                   dest="draft_min", metavar="N", help="with --mtp, up to --draft: accepted "
                   "with a one-line note (MTP drafts --draft K tokens every step)")
    h.add_argument("--spec-type", dest="spec_type", metavar="TYPE",
                   help="draft-mtp or draft-dspark (what -md/--mtp FILE does, recognised "
                   "from the file; a mismatch is refused) or none (plain decoding); "
                   "llama.cpp's other types are refused")


def resolve_llama_args(a: argparse.Namespace) -> None:
    """Check `add_llama_args`' options against mtplib's own (after --threads and --draft
    are checked): map, note in one line on stderr, or refuse naming the equivalent."""
    def note(msg: str) -> None:
        print(f"mtplib {getattr(a, 'cmd', None) or 'generate'}: note: {msg}",
              file=sys.stderr)

    if a.spec_type is not None:
        types = comma_list(a.spec_type, "--spec-type", "draft-mtp, draft-dspark or none")
        if not types or any(t not in (*SPEC_TYPES, "none") for t in types):
            raise InputError(f"--spec-type {a.spec_type}: mtplib drafts only with the model's "
                             "MTP block or a DSpark draft: give --spec-type draft-mtp or "
                             "draft-dspark with -md/--mtp FILE, or none")
        drafting = [t for t in types if t in SPEC_TYPES]
        if len(set(drafting)) > 1:
            raise InputError(f"--spec-type {a.spec_type}: give one of draft-mtp and "
                             "draft-dspark (the -md/--mtp file is one drafter)")
        if drafting and a.mtp is None:
            raise InputError(f"--spec-type {drafting[0]} needs -md/--mtp SIDECAR: the "
                             "trunk's mtp- sidecar GGUF (draft-mtp) or a DSpark draft GGUF "
                             "(draft-dspark)")
        if not drafting and a.mtp is not None:
            raise InputError(f"--spec-type {a.spec_type} contradicts -md/--mtp (which turns "
                             "MTP on): give one of them")
    if a.cache_type_k is not None or a.cache_type_v is not None:
        k, v = a.cache_type_k or "f16", a.cache_type_v or "f16"
        if k != v:
            raise InputError(f"-ctk {k} -ctv {v}: mtplib's K and V caches share one type "
                             "(--kv-type TYPE); give -ctk and -ctv the same type")
        if a.kv_type not in ("f16", k):
            raise InputError(f"--kv-type {a.kv_type} contradicts -ctk/-ctv {k}: give one")
        a.kv_type = k
    if a.threads_batch is not None and a.threads_batch != a.threads:
        raise InputError(f"-tb/--threads-batch {a.threads_batch}: mtplib uses one thread "
                         f"count for prompt and generation (--threads, here {a.threads}): "
                         f"give -t {a.threads_batch}, or leave -tb out")
    if a.draft_min is not None and a.mtp is None:
        raise InputError("--draft-min needs -md/--mtp SIDECAR (the MTP block drafts)")
    if a.n_gpu_layers is not None:
        v = a.n_gpu_layers
        if v not in ("auto", "all") and not re.fullmatch(r"-1|\d+", v):
            raise InputError(f"-ngl/--n-gpu-layers takes a number >= -1, auto or all, got "
                             f"{v!r}")
        note(f"-ngl {v} changes nothing: " + _placement(a))


#: --spec-type's drafting types, by the `RunRequest.sidecar_kind` each names
SPEC_TYPES = {"draft-mtp": "mtp", "draft-dspark": "dspark"}


def check_spec_type(a: argparse.Namespace) -> None:
    """--spec-type against the drafter the -md/--mtp file turned out to be (the request
    recognised it: deepseek4 sidecar -> MTP, dflash + markov_w1 -> DSpark)."""
    if a.spec_type is None or a.mtp is None:
        return
    kind = a.request.sidecar_kind
    asked = [t for t in comma_list(a.spec_type, "--spec-type", "") if t in SPEC_TYPES]
    if asked and SPEC_TYPES[asked[0]] != kind:
        right = next(t for t, k in SPEC_TYPES.items() if k == kind)
        what = "a DSpark draft (arch dflash + markov_w1)" if kind == "dspark" else \
            "an MTP sidecar (deepseek4)"
        raise InputError(f"--spec-type {asked[0]} but {a.mtp} is {what}: give --spec-type "
                         f"{right}, or leave --spec-type out")


def note_draft_min(a: argparse.Namespace) -> None:
    """llama.cpp's --draft-min, against the request's draft length: a one-line note, or
    refused outside 0..--draft."""
    if a.draft_min is None:
        return
    k = draft_k(a)
    if not 0 <= a.draft_min <= k:
        raise InputError(f"--draft-min must be in 0..--draft ({k}), got {a.draft_min}: "
                         f"mtplib's MTP drafts --draft K tokens every step")
    print(f"mtplib {getattr(a, 'cmd', None) or 'generate'}: note: --draft-min "
          f"{a.draft_min} changes nothing: mtplib's MTP drafts --draft {k} tokens every "
          "step (fewer only at the end of the context)", file=sys.stderr)


def _placement(a: argparse.Namespace) -> str:
    """Where the layers run, for the -ngl note (mtplib has no layer-offload setting)."""
    if a.plan:
        return ("with --plan the layers run on the shards --plan names (a shard serves a "
                "GPU with `mtplib shard serve --device gpu`)")
    try:
        from mtplib.runtime.devices import gpu_devices

        gpus = gpu_devices()
    except (MtplibError, OSError):
        return "mtplib has no layer-offload setting (upstream's default placement is used)"
    if not gpus:
        return "this llama.cpp build has no GPU device: every layer runs on the CPU"
    return ("mtplib has no layer-offload setting: the model loads with upstream's default "
            "placement (n_gpu_layers -1) on " + ", ".join(d["name"] for d in gpus))


def register(sub) -> None:
    g = sub.add_parser(
        "generate", help="decode tokens, plainly or with MTP speculative decoding",
        allow_abbrev=False,
        description="Decode on upstream llama.cpp. Without --mtp: plain decoding. With --mtp "
        "SIDECAR: the MTP block drafts --draft K tokens per step and the trunk verifies them "
        "in one batch (output identical to plain decoding). Greedy unless --temp > 0 "
        "(sample-and-match with position-keyed randomness: the same tokens with and without "
        "MTP for one --seed). llama.cpp's spellings work too: -m, -md/--model-draft, "
        "--draft-max, -n/--n-predict, -c/--ctx-size, -t, -p, -b, -ub, -fa, --rpc (each "
        "llama.cpp option without an mtplib setting is mapped, noted in one line or "
        "refused naming the equivalent). Exit 3: a "
        "ranged run moved cache state across a shard connection (see the exit codes).")
    add_engine_args(g)
    g.add_argument("--tokens", help="prompt as token ids, e.g. 1,2,3")
    add_option(g, "--prompt", help="prompt text (tokenized by the model's tokenizer)")
    add_sampling_args(g)
    add_grammar_args(g)
    g.add_argument("--trace", action="store_true",
                   help='add "steps": [{"pos", "drafts", "accepted"}] (one per verify step)')
    add_json_arg(g, '{"tokens": [...], "metrics": {...}}')
    add_log_args(g)
    g.set_defaults(fn=run)


def settings(a: argparse.Namespace):
    """The context and decoding settings of the arguments (both paths take the same)."""
    from mtplib.runtime.settings import DecodeSettings

    return DecodeSettings(n_ctx=a.ctx, n_batch=a.batch, n_ubatch=a.ubatch, n_threads=a.threads,
                          kv_type=a.kv_type, flash_attn=a.flash_attn,
                          swa_full=a.swa_full == "on", hidden_rows=a.hidden_rows)


@contextlib.contextmanager
def open_backend(a: argparse.Namespace, *, sampler=None, warm: bool = False) -> Iterator:
    """The loaded model the checked arguments' request (``a.request``, from
    `check_engine_args`) describes: an `MTPRuntime` (whole model) or, with --plan, a
    `RangedMTP` (shards started here unless --endpoints); closed (shards stopped) on exit.
    ``sampler``: replaces the request's (the default of each generation; a request's own
    sampler replaces it in `stream`). ``warm``: set up every graph a generation will use
    at load, whole-model too (a ranged backend always does), as a long-lived service
    wants. The request was checked and its policy asked when it was built: nothing is
    validated again here."""
    from mtplib.runtime.speculative import MTPRuntime

    req = a.request
    if sampler is not None:
        req = req.with_options(sampler=sampler)
    if not req.ranged:
        with MTPRuntime(req, warm=warm) as rt:
            yield rt
        return
    from mtplib.distributed.ranged_mtp import RangedMTP

    with RangedMTP(req) as r:
        yield r
