"""The default seam is ``auto`` everywhere (issue 31 item 3): one rule, the request's
(`mtplib.runtime.request.DEFAULT_SEAM`), which every entry point takes: `mtplib generate`,
`mtplib serve` and `mtplib bench`, the lanes' ``bench:`` and ``wan:`` sections (and the
committed lanes under params/), `RangedMTP`, `RangedRuntime`, `generate_ranged` and
`build_request`. ``auto`` is the ring where this build and every shard speak RPC 7.2 and no
TLS gateway is between them, else the star, and a result says per shard pair which ran and
why (``seam.pairs``): checked here on local shards of this build (the ring) and with a stock
shard in the plan (the star, naming that shard)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import yaml

from mtplib.cli import build_parser
from mtplib.distributed.client import RangedRuntime, resolve_seam, seam_pairs
from mtplib.distributed.processes import LocalShards
from mtplib.distributed.ranged_mtp import RangedMTP, generate_ranged
from mtplib.distributed.shard_report import ProbedShard
from mtplib.errors import InputError
from mtplib.lab.bench.config import BenchConfig
from mtplib.lab.wan.cold import cli_generate
from mtplib.lab.wan.config import WanConfig
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.request import DEFAULT_SEAM, RunRequest, build_request
from mtplib.runtime.rpc import client_proto_minor
from mtplib.runtime.settings import DecodeSettings

REPO = Path(__file__).resolve().parent.parent
needs_ring = pytest.mark.skipif(
    client_proto_minor() < 2, reason="the loaded build lacks patches/0007 (RPC protocol 7.2)")
PROMPT = list(range(100, 116))


def _default(fn, name: str = "seam"):
    return inspect.signature(fn).parameters[name].default


# -- one default, taken by every entry point ------------------------------------------------
def test_the_request_holds_the_one_default_and_the_library_takes_it(pair):
    assert DEFAULT_SEAM == "auto"
    assert RunRequest.__dataclass_fields__["seam"].default == DEFAULT_SEAM
    assert _default(build_request) == _default(RangedMTP) == DEFAULT_SEAM
    assert _default(generate_ranged) == DEFAULT_SEAM
    assert _default(RangedRuntime) is None  # None: build_request's default
    assert build_request(pair.trunk, plan="0-1,2-3").seam == "auto"
    # a whole-model request has no seam: the default passes, anything asked is refused
    assert build_request(pair.trunk).seam == "auto"
    for seam in ("star", "ring"):
        with pytest.raises(InputError, match="^seam needs plan"):
            build_request(pair.trunk, seam=seam)


def test_generate_serve_and_bench_default_to_auto_and_say_so():
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "cmd").choices
    for cmd in ("generate", "serve"):
        a = p.parse_args([cmd, "--model", "t.gguf"])
        assert a.seam == DEFAULT_SEAM, cmd
        text = sub[cmd].format_help()
        flat = " ".join(text.split())
        assert "(default: auto)" in flat, cmd
        assert "auto = the ring where this build and every shard speak RPC 7.2" in flat, cmd
    # bench: the lane's bench.seam unless given, and the lane's own default is auto
    assert p.parse_args(["bench"]).seam is None
    flat = " ".join(sub["bench"].format_help().split())
    assert "default: the lane's bench.seam, else auto" in flat
    assert "auto = the ring where this build and every shard speak RPC 7.2" in flat


def test_the_lanes_default_to_auto(pair):
    from mtplib.records.parameters import check_value

    assert BenchConfig().seam == WanConfig().seam == DEFAULT_SEAM
    assert BenchConfig.from_dict({}).seam == WanConfig.from_dict({}).seam == DEFAULT_SEAM
    assert check_value("bench", {"seam": "auto"})["seam"] == "auto"
    # the committed lanes leave the seam to that default (or ask for auto)
    for path in sorted((REPO / "params").glob("*.yaml")):
        lane = yaml.safe_load(path.read_text())
        sections = [("bench", lane.get("bench")), ("wan", lane.get("wan"))]
        for nb in lane.get("notebooks") or []:
            params = (nb or {}).get("parameters") or {}
            sections += [(f"{nb['notebook']}:{k}", params.get(k)) for k in ("bench", "target")]
        for where, section in sections:
            if isinstance(section, dict):
                assert section.get("seam", DEFAULT_SEAM) == DEFAULT_SEAM, (path.name, where)
    # the cold CLI runs leave the CLI's own default to it, and pass anything else
    cmd = cli_generate("t", None, plan="0-1,2-3", k=0, tokens=[1], n_new=1, wan="0")
    assert "--seam" not in cmd
    star = cli_generate("t", None, plan="0-1,2-3", k=0, tokens=[1], n_new=1, wan="0",
                        seam="star")
    assert star[star.index("--seam") + 1] == "star"


# -- what auto becomes, and what the result says ---------------------------------------------
def _info(minor: int) -> ProbedShard:
    return ProbedShard((7, minor, 0), 1, 32, 1 << 40, 1 << 30, 2 << 30)


def test_auto_rings_only_where_everything_speaks_it_and_each_pair_says_why():
    new, old = _info(2), _info(1)
    eps = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    seam, why = resolve_seam(DEFAULT_SEAM, [new, new, new], tls=False, client_minor=2)
    assert (seam, why) == ("ring", "every shard speaks RPC 7.2")
    logged = [{"from": a, "to": b, "seam": "ring", "why": ""}
              for a, b in zip(eps[:-1], eps[1:], strict=True)]
    assert seam_pairs(eps, seam, why, logged) == [
        {"from": a, "to": b, "seam": "ring", "why": "both shards speak RPC 7.2: the link opened"}
        for a, b in zip(eps[:-1], eps[1:], strict=True)]
    # a pair not set up yet (no copy between them) is not claimed either way
    assert seam_pairs(eps, seam, why, logged[:1])[1] == {
        "from": eps[1], "to": eps[2], "seam": None, "why": "no boundary copy between them yet"}
    # one 7.1 shard: auto is the star for the run, and every pair says why
    seam, why = resolve_seam(DEFAULT_SEAM, [new, new, old], tls=False, client_minor=2)
    assert (seam, why) == ("star", "shard 2 speaks RPC 7.1 (the ring needs 7.2)")
    assert seam_pairs(eps, seam, why, []) == [
        {"from": a, "to": b, "seam": "star", "why": why}
        for a, b in zip(eps[:-1], eps[1:], strict=True)]
    # an asked ring keeps upstream's per-pair fallback: its log names the pair's reason
    mixed = [logged[0], {"from": eps[1], "to": eps[2], "seam": "star",
                         "why": "a server speaks protocol 7.1 or older"}]
    assert [(x["seam"], x["why"]) for x in seam_pairs(eps, "ring", "", mixed)] == [
        ("ring", "both shards speak RPC 7.2: the link opened"),
        ("star", "a server speaks protocol 7.1 or older")]
    # TLS gateways that carry no peer links (peer_links=False: not probed as +peer) and a
    # 7.1 build: the star, said; gateways that carry them: the ring (tests/test_tls_ring.py)
    seam, why = resolve_seam(DEFAULT_SEAM, [new, new], tls=True, client_minor=2)
    assert seam == "star" and "carry no peer links" in why
    peer = ProbedShard((7, 2, 0), 1, 32, 1 << 40, 1 << 30, 2 << 30, peer_links=True)
    assert resolve_seam(DEFAULT_SEAM, [peer, peer], tls=True, client_minor=2)[0] == "ring"
    assert resolve_seam(DEFAULT_SEAM, [new, new], tls=False, client_minor=1)[0] == "star"


def _shards(build: str, n: int) -> LocalShards:
    return LocalShards(n, env=dict(os.environ, MTPLIB_UPSTREAM=build), cwd=REPO,
                       start_timeout_s=60)


@needs_ring
@pytest.mark.slow
def test_by_default_the_ring_runs_on_72_shards_and_a_stock_shard_keeps_the_star(pair):
    """No seam given: on this build's local shards (RPC 7.2) the ring runs, every pair's
    boundary values go shard to shard (peer bytes, none through the client) and each pair
    says ring; with a stock shard (RPC 7.0) in the plan the run stays on the star, the
    pair says why, naming that shard. Same tokens both ways."""
    opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1))
    with RangedMTP(str(pair.trunk), plan="0-1,2-3") as r:
        ring_toks, ring = r.generate(PROMPT, 6, opts)
    assert ring.seam["requested"] == "auto" and ring.seam["seam"] == "ring"
    assert [(p["from"], p["to"], p["seam"]) for p in ring.seam["pairs"]] == [
        (*ring.endpoints, "ring")]
    assert ring.seam_report["steps"]["decode"]["peer"]["data"] > 0
    assert ring.wire_bytes_by_class["decode"]["seam"] == 0  # nothing through the client
    with _shards("patched", 1) as new, _shards("stock", 1) as old:
        eps = new.endpoints + old.endpoints
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", endpoints=eps) as r:
            star_toks, star = r.generate(PROMPT, 6, opts)
    why = "shard 1 speaks RPC 7.0 (the ring needs 7.2)"
    assert star.seam["requested"] == "auto"
    assert (star.seam["seam"], star.seam["why"]) == ("star", why)
    assert star.seam["pairs"] == [{"from": eps[0], "to": eps[1], "seam": "star", "why": why}]
    assert star.seam["links"] == []  # upstream was not asked to ring: it logs no link
    assert "peer" not in star.seam_report["steps"]["decode"]
    assert star.wire_bytes_by_class["decode"]["seam"] > 0
    assert star_toks == ring_toks
