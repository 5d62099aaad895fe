"""The patch set's edges (issue 29 item 6), on the patched build.

- patches/0002: the queue of pipelined GETs (tests/rpc_queue_probe.py): more than 64,
  two backends on one endpoint, a split with RPC and host inputs, freeing with GETs queued.
- patches/0001 with k > 0: rejected drafts roll the compressor state back through the
  restore nodes 0001 pins to their layer's shard, on the tiny fixture and the trained pair,
  on a plan whose CSA/LID restore (layer 2) and HCA restore (layer 3) each open a shard.
- patches/0003: a K cache with no layers (an MTP context whose compressed caches are empty,
  a trunk with no ratio-4 layer) builds no K rotation instead of dividing by zero, and
  `llama_get_memory_breakdown` counts the per-device copies of the rotation.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.correctness import seeded_prompt
from mtplib.model.arch import sidecar_tensors, trunk_tensors
from mtplib.model.fixture import write_fixture, write_gguf
from mtplib.model.presets import TINY
from mtplib.model.trained import trained_paths
from mtplib.runtime import PATCHED_DIR, build_info
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.speculative import MTPRuntime

REPO = Path(__file__).resolve().parent.parent
needs_patched = pytest.mark.skipif(
    not (PATCHED_DIR / "llama_cpp" / "MTPLIB_PATCHES").is_file(),
    reason="no patched build (./dev.sh setup; MTPLIB_SKIP_PATCHED set?)")

PROMPT = seeded_prompt(7, 10)
N_NEW = 16
ONE = DecodeSettings(n_threads=1)


# -- 0002: the GET queue itself ----------------------------------------------------------------

def _queue_probe(build: str) -> dict:
    env = dict(os.environ, MTPLIB_UPSTREAM=build)
    r = subprocess.run([sys.executable, str(REPO / "tests" / "rpc_queue_probe.py")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_patched
def test_get_queue_batches_bounds_and_flushes():
    """ggml's RPC client driven directly (tests/rpc_queue_probe.py), each read checked
    against the bytes written: 100 async GETs then one synchronize are two round trips
    (64 at most pipelined on TCP) where stock waits 100 times; two backends on one
    endpoint read from two threads at once get their own bytes and do not hang; a split
    on shard B with 24 inputs from shard A waits once (stock: 24), its host (CPU) input
    takes the direct path, and a second run on the same allocation (the kept staging
    buffers) reads the new values; GETs queued when the backend and buffer are freed with
    no synchronize are sent by the buffer's free and their data arrives."""
    stock, patched = _queue_probe("stock"), _queue_probe("patched")
    assert (stock["build"], patched["build"]) == ("stock", "patched")
    for res in (stock, patched):
        assert res["many"]["equal"] and res["two"]["equal"] and not res["two"]["hung"]
        assert all(run["equal"] for run in res["split"]) and res["no_sync"]["equal"]
    assert stock["many"]["waits"] == 100 and patched["many"]["waits"] == 2
    assert [run["waits"] for run in stock["split"]] == [24, 24]
    assert [run["waits"] for run in patched["split"]] == [1, 1]


# -- 0001: rollbacks through the pinned restore nodes ---------------------------------------

def _model(name: str, pair):
    return pair if name == "tiny" else trained_paths()


@needs_patched
@pytest.mark.parametrize("plan", ["0-1,2-3", "0-1,2-2,3-3"])
@pytest.mark.parametrize("model", ["tiny", "trained"])
def test_rejections_roll_back_through_the_pinned_restores_with_no_cache_crossing(
        pair, model, plan):
    """k = 1 and 3 with n_rs_seq = k (a rejection is a tail removal: the next step restores
    the compressor state from the kept cells), with layer 2's CSA/LID restore the first
    node of a shard (and, on the 3-shard plan, layer 3's HCA restore too): MTP off's
    tokens, rejections on every run (the tiny fixture rejects every draft, the trained pair
    keeps some), and not one cache byte between shards (stock: 0.26-4.7 MB per run,
    evidence/upstream-bugs/rollback-crossing-stock.jsonl)."""
    assert build_info()["build"] == "patched"
    m = _model(model, pair)
    with MTPRuntime(str(m.trunk), None, k=0) as rt:
        plain = rt.generate(PROMPT, N_NEW)[0]
    with RangedMTP(str(m.trunk), plan=plan, sidecar=str(m.sidecar)) as r:
        for k in (1, 3):
            toks, got = r.generate(PROMPT, N_NEW, EngineOptions(k=k, settings=ONE))
            assert toks == plain, (plan, k)
            assert got.drafted > got.accepted, (plan, k)  # some drafts were rejected
            if model == "trained":
                assert got.accepted > 0, (plan, k)  # and some kept: partial rollbacks
            assert sum(got.rollbacks.values()) > 0, (plan, k)
            assert got.cache_bytes_crossing == 0, (plan, k, got.cache_bytes_crossing)


# -- 0003: no K layers, and the copies in memory_breakdown ----------------------------------

#: the tiny preset with the indexer key length equal to the head dim: the K rotation is then
#: forced on in the CSA and HCA caches too, which an MTP context leaves empty (its block has
#: ratio 0); mtplib's config check refuses it for the stock build (arch.V4Config.validate)
EQUAL_DIMS = replace(TINY, indexer_dim=TINY.head_dim)
#: no ratio-4 layer: the indexer's (LID) cache, whose rotation is always on, has no layer
NO_CSA = replace(TINY, compress_ratios=(0, 0, 128, 128, 0))


def _unchecked_pair(cfg, out: Path, name: str) -> tuple[Path, Path]:
    """A trunk + sidecar for a config `V4Config.validate` refuses (it guards the stock
    build): written with the generator's own writer."""
    out.mkdir(parents=True, exist_ok=True)
    trunk, side = out / f"{name}.gguf", out / f"mtp-{name}.gguf"
    write_gguf(trunk, cfg, trunk_tensors(cfg), 0, False, name)
    write_gguf(side, cfg, sidecar_tensors(cfg), 0, True, "mtp-" + name)
    return trunk, side


#: upstream's own API (mtplib's header check refuses these files for the stock build): the
#: trunk decodes a few tokens; with "1" an MTP context is created on the sidecar
NO_K_PROBE = """
import json, sys
from mtplib.runtime import build_info
from mtplib.runtime.lib import load
llama, _ = load()
trunk, side, mtp = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def context(path, load_mtp):
    mp = llama.llama_model_default_params()
    mp.load_mtp = load_mtp
    m = llama.llama_model_load_from_file(path.encode(), mp)
    assert m, "load failed"
    cp = llama.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 256, 1, 1
    if load_mtp:
        cp.ctx_type = llama.LLAMA_CONTEXT_TYPE_MTP
    ctx = llama.llama_init_from_model(m, cp)
    assert ctx, "context refused"
    return ctx
ctx = context(trunk, False)
toks = (llama.llama_token * 8)(*range(10, 18))
rc = llama.llama_decode(ctx, llama.llama_batch_get_one(toks, 8))
mtp_ctx = bool(context(side, True)) if mtp else None
print(json.dumps({"build": build_info()["build"], "decode": rc, "mtp_context": mtp_ctx}))
"""


def _run(code: str, build: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MTPLIB_UPSTREAM=build)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)


@needs_patched
@pytest.mark.parametrize("cfg,name,mtp", [(EQUAL_DIMS, "equal-dims", True),
                                          (NO_CSA, "no-csa", False)])
def test_a_cache_with_no_k_layers_builds_no_k_rotation(tmp_path, cfg, name, mtp):
    """Stock divides by zero (SIGFPE) finding the rotation's size for an empty cache whose
    rotation is forced on; patched builds none there and decodes."""
    trunk, side = _unchecked_pair(cfg, tmp_path, name)
    stock = _run(NO_K_PROBE, "stock", str(trunk), str(side), "1" if mtp else "0")
    assert stock.returncode != 0  # SIGFPE at the pin (-8 here)
    r = _run(NO_K_PROBE, "patched", str(trunk), str(side), "1" if mtp else "0")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["build"] == "patched" and out["decode"] == 0
    assert out["mtp_context"] is (True if mtp else None)


#: llama_get_memory_breakdown (src/llama-ext.h, a C++ symbol) returns a std::map by value;
#: read through ctypes with the Itanium C++ ABI (the result through a hidden first pointer
#: on x86-64) and libstdc++'s red-black tree layout, checked against the tree's node count
MB_PROBE = """
import ctypes, json, sys
from pathlib import Path
from mtplib.runtime import build_info
from mtplib.runtime.lib import load
from mtplib.runtime.model import Context, ContextConfig, Model
load()  # chooses the build (MTPLIB_UPSTREAM), then imports it
import llama_cpp
lib_dir = Path(llama_cpp.__file__).parent / "lib"
sym = "_Z26llama_get_memory_breakdownPK13llama_context"
f = getattr(ctypes.CDLL(str(lib_dir / "libllama.so")), sym)
f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_void_p
name = ctypes.CDLL(str(lib_dir / "libggml-base.so")).ggml_backend_buft_name
name.argtypes, name.restype = [ctypes.c_void_p], ctypes.c_char_p
words = lambda addr, n: (ctypes.c_uint64 * n).from_address(addr)
trunk, plan = sys.argv[1], sys.argv[2]
shards = None
if plan:  # the trunk across local RPC shards; their buffer types named shard0, shard1, ...
    from mtplib.distributed.processes import LocalShards
    from mtplib.runtime.rpc import open_ranged
    shards = LocalShards(plan.count(",") + 1).start()
    m, _ = open_ranged(trunk, plan, shards.endpoints)
else:
    m = Model(trunk)
def label(buft):
    n = name(buft).decode()
    for i, ep in enumerate(shards.endpoints if shards else []):
        if ep in n:
            return f"shard{i}"
    return n
with Context(m, ContextConfig(n_ctx=256, n_threads=1)) as ctx:
    rb = ctypes.create_string_buffer(64)
    f(ctypes.addressof(rb), ctx.ptr)
    hdr = words(ctypes.addressof(rb), 6)  # less<>, color, root, leftmost, rightmost, count
    out = {}
    def visit(node):
        if not node:
            return 0
        w = words(node, 8)  # color, parent, left, right, buft, model, context, compute
        out[label(w[4])] = {"model": w[5], "context": w[6], "compute": w[7]}
        return 1 + visit(w[2]) + visit(w[3])
    assert visit(hdr[2]) == hdr[5] > 0, "unexpected std::map layout"
m.close()
if shards:
    shards.close()
print(json.dumps({"build": build_info()["build"], "breakdown": out}))
"""


@needs_patched
@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="reads a std::map through the x86-64 Itanium ABI")
@pytest.mark.parametrize("preset,plan,grown", [
    ("tiny", "", {"CPU"}),
    # V4-Flash's layer pattern: CSA layers on both shards, one copy on each
    ("v4-ratio-cpu", "0-21,22-42", {"shard0", "shard1"})])
def test_memory_breakdown_counts_the_k_rotation_copies(tmp_path, preset, plan, grown):
    """The indexer cache's rotation (128 x 128 F32, the only cache with one here) is one
    64 KiB buffer per device holding indexer layers, beside the cache (0003):
    memory_breakdown's context bytes are stock's plus exactly that on each such device
    (one copy per device, however many layers it holds), the same elsewhere."""
    trunk = write_fixture(tmp_path, preset=preset).trunk
    got = {}
    for build in ("stock", "patched"):
        r = _run(MB_PROBE, build, str(trunk), plan)
        assert r.returncode == 0, r.stderr[-2000:]
        got[build] = json.loads(r.stdout.strip().splitlines()[-1])
        assert got[build]["build"] == build
    stock, patched = got["stock"]["breakdown"], got["patched"]["breakdown"]
    assert set(stock) == set(patched) and grown <= set(stock)
    for buft in stock:
        assert patched[buft]["model"] == stock[buft]["model"]
        grew = patched[buft]["context"] - stock[buft]["context"]
        assert grew == (128 * 128 * 4 if buft in grown else 0), (buft, grew)
