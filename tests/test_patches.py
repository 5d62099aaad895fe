"""The patch set under patches/ (upstream fixes for ranged V4 decoding), stock vs patched.

`./dev.sh setup` applies, checks and reverse-checks each patch against the pinned sdist and
installs the patched build into .upstream/patched; these tests check that the installed
build is the current patch set and that it does what its write-up says
(evidence/upstream-bugs/README.md bug 4: patches/0001; evidence/upstream-patches/README.md:
patches/0002-0004)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtplib.model.trained import trained_paths
from mtplib.runtime import PATCHED_DIR

REPO = Path(__file__).resolve().parent.parent
PATCHES = sorted((REPO / "patches").glob("*.patch"))
MARKER = PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES"
needs_patched = pytest.mark.skipif(
    not MARKER.is_file(), reason="no patched build (./dev.sh setup; MTPLIB_SKIP_PATCHED set?)")

PROBE = """
import json, sys
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions
trunk, rs = sys.argv[1], int(sys.argv[2])
with RangedMTP(trunk, plan="0-1,2-3", allow_cache_crossing=True) as r:
    opts = EngineOptions(k=0, n_rs_seq=rs, settings=DecodeSettings(n_ctx=256, n_threads=1))
    r.generate(list(range(100, 132)), 4, opts)
    toks, m = r.generate(list(range(100, 132)), 6, opts)
print(json.dumps({"build": upstream_info()["build"], "tokens": toks,
                  "cache": m.cache_bytes_crossing, "waits": m.waits_per_step["decode"]}))
"""


def _probe(build: str, n_rs_seq: int) -> dict:
    env = dict(os.environ, MTPLIB_UPSTREAM=build)
    r = subprocess.run([sys.executable, "-c", PROBE, str(trained_paths().trunk), str(n_rs_seq)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_patch_files_are_git_style_against_llama_cpp():
    assert PATCHES, "patches/ is empty"
    for p in PATCHES:
        text = p.read_text()
        # an optional upstream-style header (what, why, ...) before the first diff, which
        # git apply skips: no diff line in it
        start = 0 if text.startswith("diff --git") else text.find("\ndiff --git") + 1
        header, text = text[:start], text[start:]
        assert not any(line.startswith(("--- ", "+++ ", "@@ ")) for line in header.splitlines())
        assert text.startswith(("diff --git a/src/", "diff --git a/ggml/src/",
                                "diff --git a/ggml/include/")), p.name
        assert "\n--- a/" in text and "\n+++ b/" in text


@needs_patched
def test_installed_patched_build_is_the_current_patch_set():
    lines = MARKER.read_text().split()
    want = hashlib.sha256(b"".join(p.read_bytes() for p in PATCHES)).hexdigest()[:12]
    assert lines[0] == want, "stale .upstream/patched: run ./dev.sh setup"
    assert lines[1:] == [f"patches/{p.name}" for p in PATCHES]


@needs_patched
@pytest.mark.slow
def test_patched_keeps_the_compressor_state_on_its_shard():
    """n_rs_seq > 0 on plan 0-1,2-3: stock copies layer 2's HCA state from shard 1 to
    shard 0 on every decode (2 extra waits); patched moves no cache byte and waits as
    often as with n_rs_seq = 0. Same tokens."""
    stock, patched = _probe("stock", 2), _probe("patched", 2)
    plain = _probe("patched", 0)
    assert (stock["build"], patched["build"]) == ("stock", "patched")
    assert stock["cache"] > 0  # upstream's behaviour at the pin (bug 4)
    assert patched["cache"] == 0 and patched["waits"] == plain["waits"] < stock["waits"]
    assert stock["tokens"] == patched["tokens"] == plain["tokens"]


WAN_PROBE = """
import json, sys
from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.distributed.relay import WanLink
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import EngineOptions
trunk, plan = sys.argv[1], sys.argv[2]
with RangedMTP(trunk, plan=plan, seam="star") as r:  # about the star: 0002-0004's figures
    opts = EngineOptions(k=0, settings=DecodeSettings(n_ctx=256, n_threads=1), head="client")
    r.generate(list(range(100, 132)), 4, opts)
    for relay in r.rt.relays.relays:  # a short WAN: a pipelined request is then one wait
        relay.set_link(WanLink(20))
    toks, m = r.generate(list(range(100, 132)), 6, opts)
print(json.dumps({"build": upstream_info()["build"], "tokens": toks,
                  "waits": m.waits_per_step["decode"],
                  "bytes": m.wire_bytes_by_class["decode"], "steps": m.steps_by_label}))
"""


def _wan_probe(build: str, plan: str) -> dict:
    env = dict(os.environ, MTPLIB_UPSTREAM=build)
    r = subprocess.run([sys.executable, "-c", WAN_PROBE, str(trained_paths().trunk), plan],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_patched
@pytest.mark.slow
@pytest.mark.parametrize("plan,n_shards", [("0-1,2-3", 2), ("0-0,1-2,3-3", 3)])
def test_patched_waits_once_per_shard_and_sends_no_constants(plan, n_shards):
    """A plain decode on the star (asked: the default, auto, rings on the patched build),
    every shard behind a 20 ms link: stock waits 2 per seam + 1 (two hc*n_embd tensors per
    seam, one blocking GET each) and re-sends the indexer's rotation matrix every step;
    patched (0002-0004) waits once per shard, moves one tensor per seam and no constant.
    Same tokens."""
    stock, patched = _wan_probe("stock", plan), _wan_probe("patched", plan)
    assert (stock["build"], patched["build"]) == ("stock", "patched")
    assert stock["tokens"] == patched["tokens"]
    assert stock["waits"] == 2 * (n_shards - 1) + 1
    assert patched["waits"] == n_shards
    n = stock["steps"]["decode"]
    assert stock["bytes"]["seam"] == 2 * patched["bytes"]["seam"] > 0
    assert stock["bytes"]["constants"] == n * 65536  # 128 x 128 F32, one CSA shard
    assert patched["bytes"]["constants"] == 0
    assert stock["bytes"]["cache"] == patched["bytes"]["cache"] == 0


def _llama_split(build: str, shards: int) -> dict:
    env = dict(os.environ, MTPLIB_UPSTREAM=build)
    r = subprocess.run([sys.executable, "-m", "mtplib.reports.upstream_patches.rpc_llama_split",
                        "--shards", str(shards), "--layers", str(2 * shards)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_patched
@pytest.mark.slow
@pytest.mark.parametrize("shards", [2, 3])
def test_patched_rpc_split_of_another_architecture_is_bit_identical(shards):
    """Generic (not V4): a tiny llama model over 2 and 3 RPC shards gives the same tokens
    and the same logits bytes on both builds, with no more waits."""
    stock, patched = _llama_split("stock", shards), _llama_split("patched", shards)
    assert (stock["build"], patched["build"]) == ("stock", "patched")
    assert stock["tokens"] == patched["tokens"]
    assert stock["logits_sha256"] == patched["logits_sha256"]
    for s, p in zip(stock["waits_per_decode_per_shard"], patched["waits_per_decode_per_shard"],
                    strict=True):
        assert sum(p) <= sum(s)
