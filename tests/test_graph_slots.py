"""Graph descriptions sent per step (issue 29 item 1): patches/0005 (each V4 layer complete
before the next, so a device's nodes form one split) and 0006 (the RPC server keeps 8
graphs per device in slots the client assigns, protocol 7.1) against the stock pin.

At the pin every verify step of ranged MTP re-sends each shard's whole graph
(`GRAPH_COMPUTE`, 329,064 bytes per step on the trained pair over 0-1,2-3): with
``n_rs_seq > 0`` the scheduler cuts V4's graph into alternating splits, and ggml-rpc keeps one
graph uid per device. Patched, a repeated step is a `GRAPH_RECOMPUTE_SLOT` of 8 bytes per
device: these tests fail when a whole graph is sent again for a width already seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtplib.distributed.processes import LocalShards
from mtplib.model.trained import trained_paths
from mtplib.runtime import PATCHED_DIR
from mtplib.runtime.rpc import client_proto_minor

REPO = Path(__file__).resolve().parent.parent
MARKER = PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES"
SLOTS_PATCH = "patches/0006-rpc-client-assigned-graph-slots.patch"
needs_slots = pytest.mark.skipif(
    not MARKER.is_file() or SLOTS_PATCH not in MARKER.read_text().split(),
    reason="no patched build with graph slots (./dev.sh setup)")

PROBE = """
import json, sys
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions
trunk, side, k, placement, endpoints = sys.argv[1:6]
k = int(k)
eps = endpoints.split(",") if endpoints else None
with RangedMTP(trunk, plan="0-1,2-3", sidecar=side if k else None, mtp_placement=placement,
               endpoints=eps, allow_cache_crossing=True) as r:
    opts = EngineOptions(k=k, settings=DecodeSettings(n_ctx=256, n_threads=1))
    runs = [r.generate([5, 9, 17, 33, 2, 40, 41, 42], 16, opts) for _ in range(2)]
out = {"build": upstream_info()["build"], "tokens": [t for t, _ in runs], "steps": []}
for _, m in runs:
    out["steps"].append({lab: {"steps": row["steps"], "graph": row["graph"],
                               "graph_sends": row["graph_sends"], "bytes": row["bytes"]}
                         for lab, row in m.seam_report["steps"].items() if lab != "load"})
print(json.dumps(out))
"""


def _probe(build: str, k: int, placement: str = "auto", endpoints: str = "",
           env_extra: dict | None = None) -> dict:
    p = trained_paths()
    env = dict(os.environ, MTPLIB_UPSTREAM=build, **(env_extra or {}))
    r = subprocess.run([sys.executable, "-c", PROBE, str(p.trunk), str(p.sidecar), str(k),
                        placement, endpoints],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _per_step(run: dict, label: str) -> float:
    row = run[label]
    return row["graph"] / row["steps"]


@needs_slots
@pytest.mark.slow
def test_stock_resends_every_graph_and_patched_recomputes_from_slots():
    """k=2, drafter in the client: stock sends both shards' whole graphs on every verify
    step; patched sends none in the first generation, whose widths were all seen (the set-up
    at load runs each of them), 8 bytes per device and step instead. Same tokens as MTP off."""
    stock, patched = _probe("stock", 2), _probe("patched", 2)
    off = _probe("patched", 0)
    assert (stock["build"], patched["build"]) == ("stock", "patched")
    assert stock["tokens"] == patched["tokens"] == off["tokens"]
    s, p = stock["steps"][1], patched["steps"][0]
    # the fault at the pin: every shard's whole graph every step (twice: alternating splits)
    assert s["verify"]["graph_sends"] >= 2 * s["verify"]["steps"]
    assert _per_step(s, "verify") > 100_000
    first, later = patched["steps"]
    for label in ("prefill", "verify", "decode"):  # every width was warmed at load
        if label in first and first[label]["steps"]:
            assert first[label]["graph_sends"] == 0, (label, first[label])
            assert _per_step(first, label) <= 2 * 8 + 1, (label, first[label])
    # a later generation: no graph again either (each split input has one copy: with
    # llama.cpp's pipeline parallelism a rebuilt graph took the next of 4 copies' inputs,
    # serialized to other bytes and was sent again, 2-6 graphs per generation)
    for label, row in later.items():
        assert row["graph_sends"] == 0, (label, row)
    # with every width in a slot, a verify step moves at most twice a plain step's bytes
    plain = off["steps"][0]["decode"]
    verify = p["verify"]
    assert verify["bytes"] / verify["steps"] <= 2 * plain["bytes"] / plain["steps"]


@needs_slots
@pytest.mark.slow
def test_mtp_on_the_tail_shares_the_tail_device_without_resending():
    """The MTP context on the tail shard computes on the same RPC device as the target:
    with one graph per device they evicted each other every step; with slots neither is
    sent again once seen."""
    patched = _probe("patched", 2, placement="tail")
    off = _probe("patched", 0)
    assert patched["tokens"] == off["tokens"]
    run = patched["steps"][0]
    for label, row in run.items():
        assert row["graph_sends"] == 0, (label, row)
    for label, row in patched["steps"][1].items():  # nor in a later generation
        assert row["graph_sends"] == 0, (label, row)


def _shards(build: str, n: int) -> LocalShards:
    """n shard processes of ``build`` (started on entering, stopped on leaving)."""
    return LocalShards(n, env=dict(os.environ, MTPLIB_UPSTREAM=build), cwd=REPO,
                       start_timeout_s=60)


@needs_slots
@pytest.mark.slow
def test_patched_client_falls_back_on_stock_shards():
    """A 7.1 client and 7.0 servers: no slot command is sent (a stock server would close the
    connection on one); the client keeps upstream's one graph per device, same tokens."""
    with _shards("stock", 2) as sh:
        mixed = _probe("patched", 2, endpoints=",".join(sh.endpoints))
    same = _probe("patched", 2)
    assert mixed["tokens"] == same["tokens"]
    assert mixed["steps"][1]["verify"]["graph_sends"] > 0  # no slots: widths evict


@needs_slots
@pytest.mark.slow
def test_stock_client_refuses_patched_shards_before_upstream_aborts():
    """Upstream's 7.0 client aborts the process on a 7.1 server; mtplib's probe refuses it
    first, with one line naming both versions."""
    with _shards("patched", 2) as sh:
        p = trained_paths()
        r = subprocess.run([sys.executable, "-m", "mtplib.cli", "generate", "--model",
                            str(p.trunk), "--tokens", "1,2,3", "--n", "2", "--plan", "0-1,2-3",
                            "--endpoints", ",".join(sh.endpoints)],
                           capture_output=True, text=True, timeout=300, cwd=REPO,
                           env=dict(os.environ, MTPLIB_UPSTREAM="stock"))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    # the patched shards' minor: 7.1 with patches/0006, 7.2 with 0007 (the seam)
    assert f"7.{client_proto_minor()}" in r.stderr and "7.0" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
