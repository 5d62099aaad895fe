"""`mtplib serve`: a long-lived OpenAI-compatible HTTP service over one loaded model.

This module parses and checks the command line; the service is the package
`mtplib.serve` (`launch`). The model is loaded once (whole, or ranged on shards with
--plan) with exactly generate's options (`generate.add_engine_args`, `check_engine_args`,
`open_backend`), so setup is paid once and not per request.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
from pathlib import Path

from mtplib import envs
from mtplib.commands.common import add_json_arg, add_log_args, add_option, setup_logging
from mtplib.commands.generate import (
    add_engine_args,
    add_sampling_args,
    check_engine_args,
    draft_k,
    open_backend,
)
from mtplib.commands.llama_server_args import add_llama_server_args, apply_server_flags
from mtplib.errors import InputError

#: --header-timeout / --body-timeout defaults, seconds (`mtplib.serve.deadlines`)
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 10.0, 30.0

#: the environment variable read for --api-key when the flag is not given (keeps the key
#: out of the process list)
API_KEY_ENV = envs.API_KEY
#: the most --parallel slots: upstream's LLAMA_MAX_SEQ (src/llama-cparams.h)
PARALLEL_MAX = 256
#: what --parallel -1 (llama-server's auto) runs: one slot, the default, until more is
#: measured better on the hosts mtplib serves from
PARALLEL_AUTO = 1


def add_parallel_arg(s: argparse.ArgumentParser) -> None:
    """``--parallel N`` / llama-server's ``-np N``: the number of slots (sequences decoded
    together). The one definition; `check_parallel` says which values run."""
    add_option(s, "--parallel", type=int, default=1, metavar="N",
               help="slots decoded together, continuous batching (llama-server's -np); "
               "each slot gets --ctx / N positions, as llama-server's; default 1")


def check_parallel(a: argparse.Namespace) -> None:
    """Refuse a --parallel outside 1..PARALLEL_MAX in one line; -1 (llama-server's auto)
    is PARALLEL_AUTO."""
    if a.parallel == -1:
        a.parallel = PARALLEL_AUTO
    if not 1 <= a.parallel <= PARALLEL_MAX:
        raise InputError(f"--parallel must be in 1..{PARALLEL_MAX} (or -1: auto), got "
                         f"{a.parallel}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_serve_args(a: argparse.Namespace) -> None:
    check_parallel(a)
    if not 0 <= a.port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {a.port}")
    if not _is_loopback(a.host) and not a.allow_remote:
        raise InputError(f"--host {a.host} is not a loopback address: the service has no "
                         "authentication unless --api-key is given; add --allow-remote to "
                         "serve beyond this machine")
    for opt, v, lo in (("--queue", a.queue, 0), ("--max-body-bytes", a.max_body_bytes, 1024),
                       ("--shutdown-timeout", a.shutdown_timeout, 0)):
        if v < lo:
            raise InputError(f"{opt} must be >= {lo}, got {v}")
    if not math.isfinite(a.shutdown_timeout):
        raise InputError(f"--shutdown-timeout must be a finite number of seconds, got "
                         f"{a.shutdown_timeout}")
    for opt, v in (("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout)):
        if not (math.isfinite(v) and v > 0):
            raise InputError(f"{opt} must be a finite number of seconds > 0, got {v}")
    source = "--api-key"
    if a.api_key is None and envs.api_key() is not None:
        # set but empty is a mistake (a key that did not expand), not "no key": refused
        # like --api-key '' rather than served without authentication
        a.api_key, source = envs.api_key(), f"${API_KEY_ENV}"
    if a.api_key is not None and not a.api_key.strip():
        raise InputError(f"{source} is empty: give a key, or unset {API_KEY_ENV} and leave "
                         "--api-key out to serve without one")


def _config(a: argparse.Namespace, backend):
    """What the HTTP layer needs of the model: its name, context, draft length, the
    request defaults and limits given here, and the model's facts read from the GGUF
    header (`mtplib.serve.config.model_facts`), not from upstream."""
    from mtplib.runtime import build_info
    from mtplib.serve.config import ServeConfig, fingerprint, model_facts

    facts = model_facts(a.request.trunk_header, backend)  # read once, by the request
    chat = getattr(a, "chat", None)  # apply_server_flags' (--chat-template, --no-jinja)
    meta = {"plan": a.plan, "head": a.head, "upstream": build_info()}
    if a.plan:
        meta["mtp_placement"] = a.mtp_placement
        # which seam the loaded (and warmed) session runs, asked, chosen and why, per
        # shard pair: /v1/models' meta and the ready line say it
        meta["seam"] = backend.seam_summary()
    return ServeConfig(
        model_id=a.alias or Path(a.model).name, n_ctx=int(backend.n_ctx),
        n_vocab=facts.n_vocab, eog=facts.eog, k=draft_k(a), default_n=a.n,
        default_temperature=a.temp, default_top_p=a.top_p, default_seed=a.seed,
        queue_max=a.queue, max_body_bytes=a.max_body_bytes, api_key=a.api_key,
        chat_template=chat.template if chat else facts.chat_template,
        chat_format=chat.format if chat else None,
        bos_token=facts.bos_token, eos_token=facts.eos_token, meta=meta,
        model_path=str(a.model), fingerprint=fingerprint(meta["upstream"]),
        bos_id=facts.bos_id)


def run(a: argparse.Namespace) -> int:
    setup_logging(a)
    _check_serve_args(a)
    check_engine_args(a)
    apply_server_flags(a)  # llama-server's flags: the chat template checked, no-ops logged
    from mtplib.serve.launch import LaunchOptions, launch
    from mtplib.serve.logs import log_line

    if not _is_loopback(a.host):
        log_line(f"WARNING: serving on {a.host}, beyond loopback. "
                 + ("Requests need the API key (Authorization: Bearer)." if a.api_key else
                    "There is NO authentication: anyone who can reach this port can run "
                    "generations; give --api-key (or $MTPLIB_API_KEY)."), logging.WARNING)
    opts = LaunchOptions(
        host=a.host, port=a.port, model=str(a.model), plan=a.plan, parallel=a.parallel,
        shutdown_timeout=a.shutdown_timeout, header_timeout=a.header_timeout,
        body_timeout=a.body_timeout, verbose=bool(a.verbose), json=bool(a.json))
    # the request check_engine_args built (its sampler: the defaults of a request that
    # gives none), loaded once
    return launch(opts, load=lambda: open_backend(a, warm=True),
                  config_of=lambda backend: _config(a, backend))


def register(sub) -> None:
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP service over one loaded model",
        allow_abbrev=False,
        description="Load the model once (the same options as generate: whole, or ranged "
        "on shards with --plan [--endpoints]) and serve OpenAI's API on HOST:PORT: "
        "POST /v1/completions and /v1/chat/completions (stream: true gives server-sent "
        "events), GET /v1/models and /health. Requests run one at a time in arrival order "
        "(--parallel N: N at once, stepped together in one batch); up to --queue wait, "
        "more get 503. Each response carries llama-server's timings "
        "(prompt_n, prompt_ms, predicted_n, predicted_ms, predicted_per_second, draft_n, "
        "draft_n_accepted). Bad requests get a 4xx JSON error and the service keeps "
        "serving. Each connection must send its headers within --header-timeout and its body "
        "within --body-timeout (else 408, closed). SIGTERM or Ctrl-C: stop accepting, "
        "answer the waiting requests 503, let the running one finish up to "
        "--shutdown-timeout (then cut it, 503), close the model and shards, exit 0. A "
        "shard lost, hung or restarted fails the running request with a 503 naming it; "
        "/health is 503 until the service has reconnected its shards (restarting its own, "
        "re-probing --endpoints with backoff), then it serves again. --n, "
        "--temp, --top-p and "
        "--seed are the defaults of a request that leaves them out. llama-server's launch line "
        "works: each of its options works, is accepted with a logged note where it changes "
        "nothing here, or is refused naming mtplib's equivalent (docs/cli.md's table).")
    add_engine_args(s)
    add_sampling_args(s)
    add_parallel_arg(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; beyond loopback only with --allow-remote")
    s.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free "
                   "one, printed when listening)")
    s.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (a warning is printed; without "
                   "--api-key anyone who reaches the port can use it)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                   f"(default: ${API_KEY_ENV}, else no key)")
    s.add_argument("--alias", default=None,
                   help="the model's id in the API (default: the trunk's file name)")
    s.add_argument("--queue", type=int, default=8,
                   help="requests that may wait behind the running one; more get 503")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; larger ones get 413")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds SIGTERM lets the running request finish before cutting it "
                   "(answered 503; waiting requests get 503 at once)")
    s.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                   help="a connection's request line and headers must arrive within S "
                   "seconds (of connecting, or of the previous response), else 408 and "
                   "closed")
    s.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help="a request's body must arrive within S seconds of its headers, "
                   "else 408 and closed")
    add_json_arg(s, 'the "listening" line (url, port, model)')
    add_log_args(s)
    add_llama_server_args(s)  # llama-server's launch line (docs/cli.md's table)
    s.set_defaults(fn=run)
