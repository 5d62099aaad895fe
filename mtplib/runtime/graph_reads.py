"""What upstream's graphs actually read and what its caches actually allocate.

The ownership derivation (mtplib.ownership.derivation) restates upstream's source; this module
checks it against the pinned build instead of trusting it:

* `observe`: load a model, create a context with an eval callback (cb_eval), run one
  decode (main graph, or the MTP graph on a model loaded with load_mtp) and record every
  weight tensor any graph node reads (through views), every cache tensor the graph touches
  and the exact size of each cache buffer (ggml_backend_buffer_get_size);
* `check_reads` / `check_caches`: compare those with the derived read_by and cache bytes;
* `table_check`: load a weight-less table with no_alloc (metadata only, nothing read or
  allocated) in a child process, to show upstream accepts a real-scale tensor table.

Policy: the MTP graph's decode runs the MTP block, so `observe` (graph "mtp") and
`check_pair` ask the deployment policy first (`mtplib.runtime.routing.require_mtp`, through
`negotiate()`); under alpha they raise RouteRefused naming it, before any model is loaded.

Crash traps (reference §3/§4): upstream aborts the process on some bad calls, so every
input is validated by mtplib.runtime.model.Context first, weight-less files are refused
before any decode, and the no_alloc load runs in a child process.
"""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mtplib.contract.capabilities import Policy
from mtplib.errors import InputError
from mtplib.model.fixture import require_weights
from mtplib.model.gguf_header import ModelFileError, read_header_fast, require_deepseek4
from mtplib.model.validate import validate_header
from mtplib.ownership.derivation import (
    CacheParams,
    CacheTensor,
    Inventory,
    cache_buffers,
    cache_tensors,
)
from mtplib.runtime import ggml_tensor as gt
from mtplib.runtime.lib import LOG_TAIL, UpstreamError, load
from mtplib.runtime.model import Context, ContextConfig, Model, RuntimeInputError
from mtplib.runtime.routing import require_mtp

CACHE_NAME_RE = re.compile(r"^(cache_[kv]_l\d+|dsv4_(csa|hca|lid)_state_(kv|score)_l\d+)$")
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)


class LoadedModel(Model):
    """A Model loaded for observation: like Model, but it can load a combined trunk+MTP
    file with load_mtp (upstream's single-file layout) and it refuses weight-less files."""

    def __init__(self, path: str | Path, *, load_mtp: bool = False) -> None:  # noqa: D107
        self.header = read_header_fast(path)
        require_deepseek4(self.header)
        require_weights(self.header)
        validate_header(self.header)  # what upstream would abort on, refused first
        if load_mtp and int(self.header.kv.get("deepseek4.nextn_predict_layers", 0) or 0) < 1:
            raise ModelFileError(f"{path}: load_mtp needs a file with an MTP block")
        if not load_mtp and self.header.is_mtp_only:
            raise ModelFileError(f"{path} is an MTP sidecar; load it with load_mtp=True")
        llama, self.ext = load()
        self.llama = llama
        self.path = Path(path)
        self.load_mtp = load_mtp
        self._keep = []
        mp = llama.llama_model_default_params()
        mp.load_mtp = load_mtp
        m = llama.llama_model_load_from_file(str(self.path).encode(), mp)
        if not m:
            raise UpstreamError(f"upstream failed to load {self.path}")
        self.ptr = m
        self.vocab = llama.llama_model_get_vocab(m)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(llama.llama_model_n_embd(m))
        self.n_embd_out = int(llama.llama_model_n_embd_out(m))
        self.n_layer = int(llama.llama_model_n_layer(m))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(m))
        self.size_bytes = int(llama.llama_model_size(m))


@dataclass(frozen=True)
class ObservedCache:
    name: str
    buffer: int  # buffer address: one per upstream cache object
    shape: tuple[int, ...]
    dtype: str
    bytes: int


@dataclass
class Observation:
    """One decode's reads and the cache buffers behind them."""

    graph: str  # "main" or "mtp"
    path: str
    params: dict
    weights: set[str] = field(default_factory=set)
    caches: dict[tuple[str, int], ObservedCache] = field(default_factory=dict)
    buffer_bytes: dict[int, int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def cache_log(self) -> list[str]:
        """Upstream's own lines about the caches it created (sizes in MiB, cells, layers)."""
        keep = ("creating", "size =", "state = ")
        return [s.rstrip() for s in self.log if any(k in s for k in keep)
                and ("cache" in s or "state" in s)]

    def to_json(self) -> dict:
        return {"graph": self.graph, "path": self.path, "params": self.params,
                "weights": sorted(self.weights),
                "caches": [asdict(c) for c in sorted(self.caches.values(),
                                                      key=lambda c: (c.buffer, c.name))],
                "buffer_bytes": {str(k): v for k, v in self.buffer_bytes.items()}}


def buffer_size(buf: int) -> int:
    """Bytes of a ggml backend buffer (ggml_backend_buffer_get_size)."""
    lib = gt.ggml()
    if not getattr(lib, "_mtplib_bufsize", False):
        lib.ggml_backend_buffer_get_size.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_buffer_get_size.restype = ctypes.c_size_t
        lib._mtplib_bufsize = True
    return int(lib.ggml_backend_buffer_get_size(buf))


def _collector(obs: Observation):
    lib = gt.ggml()

    def fn(t: gt.GGMLTensor, ask: bool) -> bool:
        if not ask:
            return False
        for s in (t, *gt.sources(t)):
            b = s
            while b.view_src:
                b = b.view_src.contents
            if not b.buffer:
                continue
            nm = gt.name(b)
            if gt.is_weight(b):
                obs.weights.add(nm)
            elif CACHE_NAME_RE.match(nm):
                key = (nm, int(b.buffer))
                if key not in obs.caches:
                    obs.caches[key] = ObservedCache(
                        nm, int(b.buffer), tuple(int(x) for x in b.ne[:3]),
                        GGML_TYPE_NAMES.get(b.type, str(b.type)),
                        int(lib.ggml_nbytes(ctypes.addressof(b))))
        return False  # never ask to see a computed node: observation only

    return gt.eval_callback(fn)


def observe(path: str | Path, params: CacheParams, *, graph: str = "main",
            load_mtp: bool | None = None, n_tokens: int = 8,
            flash_attn: str = "auto", n_threads: int = 2,
            policy: Policy | str | None = None) -> Observation:
    """Run one decode of ``graph`` on ``path`` and record what it reads and allocates.

    graph "main": the target graph over PROMPT[:n_tokens]; graph "mtp": an MTP context on
    ``path`` loaded with load_mtp, fed PROMPT tokens with deterministic hidden rows (the
    values do not matter for what is read). Context parameters come from ``params``.
    The MTP graph is refused (RouteRefused) under a policy that disables MTP.
    """
    if graph not in ("main", "mtp"):
        raise InputError(f"graph must be 'main' or 'mtp', got {graph!r}")
    if not 1 <= n_tokens <= len(PROMPT):
        raise RuntimeInputError(f"n_tokens must be in 1..{len(PROMPT)}")
    load_mtp = (graph == "mtp") if load_mtp is None else load_mtp
    if graph == "mtp" and not load_mtp:
        raise RuntimeInputError("the MTP graph needs a model loaded with load_mtp")
    if graph == "mtp":
        require_mtp("the MTP graph check", policy=policy)
    eff = params.effective()
    obs = Observation(graph, str(path), {**asdict(params), **eff, "flash_attn": flash_attn})
    cb = _collector(obs)
    with LoadedModel(path, load_mtp=load_mtp) as model:
        cfg = ContextConfig(n_ctx=params.n_ctx, n_batch=params.n_batch,
                            n_ubatch=params.n_ubatch, n_seq_max=params.n_seq,
                            n_rs_seq=params.n_rs_seq, n_threads=n_threads,
                            kv_type=params.type_k, flash_attn=flash_attn,
                            swa_full=params.swa_full, mtp=graph == "mtp")
        LOG_TAIL.clear()
        with Context(model, cfg, cb_eval=cb) as ctx:
            obs.log = list(LOG_TAIL)
            toks = list(PROMPT[:n_tokens])
            if graph == "main":
                ctx.decode(toks, range(n_tokens), logits=True)
            else:
                rows = np.random.default_rng(0).standard_normal(
                    (n_tokens, ctx.width)).astype(np.float32)
                ctx.decode(toks, range(1, n_tokens + 1), logits=True, rows=rows)
            for c in obs.caches.values():
                obs.buffer_bytes.setdefault(c.buffer, buffer_size(c.buffer))
    return obs


# -- comparisons --------------------------------------------------------------------------

def derived_reads(inv: Inventory, graph: str, file: str) -> set[str]:
    return {t.name for t in inv.tensors if t.file == file and graph in t.read_by}


def check_reads(inv: Inventory, obs: Observation, file: str) -> dict:
    """Derived read_by of ``file``'s tensors vs the weights ``obs`` saw (names)."""
    want = derived_reads(inv, obs.graph, file)
    got = set(obs.weights)
    return {"graph": obs.graph, "file": file, "derived": len(want), "observed": len(got),
            "missing_in_upstream": sorted(want - got), "unexpected_in_upstream": sorted(got - want),
            "equal": want == got}


def derived_caches(inv: Inventory, params: CacheParams, graph: str,
                   *, combined_main: bool | None = None) -> list[CacheTensor]:
    """The cache tensors the derivation says the context of ``graph`` allocates."""
    cfg = inv.config
    if graph == "mtp":
        return cache_tensors(cfg, params, context="mtp")
    out = cache_tensors(cfg, params, context="main")
    combined = inv.layout == "combined" if combined_main is None else combined_main
    if not combined:
        out = [c for c in out if c.layer < cfg.n_layer]
    return out


def check_caches(derived: list[CacheTensor], obs: Observation) -> dict:
    """Derived cache tensors and buffer sizes vs upstream's.

    Tensors: every tensor the graph touched (name, shape, dtype, bytes) must be a derived
    tensor that the derivation marks read, and every derived read tensor must be touched.
    Buffers: each upstream cache buffer is matched to the derived cache whose read tensors
    are exactly the buffer's observed tensors, and their byte sizes must be equal (the
    derived size counts tensors the graph never reads, e.g. the MTP V cache).
    """
    def key(name, shape, dtype, nbytes):
        return (name, tuple(shape), dtype, int(nbytes))

    want = Counter(key(c.name, c.shape, c.dtype, c.bytes) for c in derived if c.read)
    got = Counter(key(c.name, c.shape, c.dtype, c.bytes) for c in obs.caches.values())
    bufs_derived = cache_buffers(derived)
    by_cache: dict[tuple[str, str], set] = {}
    for c in derived:
        if c.read:
            by_cache.setdefault((c.context, c.cache), set()).add(
                key(c.name, c.shape, c.dtype, c.bytes))
    by_buffer: dict[int, set] = {}
    for c in obs.caches.values():
        by_buffer.setdefault(c.buffer, set()).add(key(c.name, c.shape, c.dtype, c.bytes))
    buffers = []
    matched = set()
    for buf, ts in by_buffer.items():
        hits = [k for k, v in by_cache.items() if v == ts]
        row = {"upstream_bytes": obs.buffer_bytes.get(buf), "tensors": len(ts)}
        if len(hits) == 1:
            matched.add(hits[0])
            row.update(cache=hits[0][1], derived_bytes=bufs_derived[hits[0]])
        else:
            row.update(cache=None, derived_bytes=None,
                       problem=f"{len(hits)} derived caches have exactly these tensors")
        row["equal"] = row["derived_bytes"] == row["upstream_bytes"]
        buffers.append(row)
    unmatched = sorted(c for k, c in ((k, k[1]) for k in by_cache) if k not in matched)
    return {
        "graph": obs.graph,
        "tensors_equal": want == got,
        "missing_in_upstream": sorted(map(list, (want - got).elements())),
        "unexpected_in_upstream": sorted(map(list, (got - want).elements())),
        "buffers": sorted(buffers, key=lambda r: str(r["cache"])),
        "unmatched_derived_caches": unmatched,
        "derived_total": sum(bufs_derived.values()),
        "upstream_total": sum(obs.buffer_bytes.values()),
        "equal": (want == got and not unmatched and all(b["equal"] for b in buffers)
                  and sum(bufs_derived.values()) == sum(obs.buffer_bytes.values())),
    }


def check_pair(inv: Inventory, params: CacheParams, *, flash_attn: str = "auto",
               policy: Policy | str | None = None) -> dict:
    """Main decode on the trunk and MTP decode on the sidecar (or the combined file loaded
    with load_mtp): reads and caches compared with the derivation. JSON-serialisable.
    Refused (RouteRefused) under a policy that disables MTP, before the main decode."""
    if not inv.has_mtp:
        raise InputError("check_pair needs a trunk with an MTP block (pair or combined)")
    pol = require_mtp("check_pair (the MTP graph)", policy=policy)
    trunk = inv.paths["trunk"]
    mtp_path, mtp_file = (inv.paths["mtp"], "mtp") if inv.layout == "pair" else (trunk, "trunk")
    main = observe(trunk, params, graph="main", flash_attn=flash_attn)
    mtp = observe(mtp_path, params, graph="mtp", flash_attn=flash_attn, policy=pol)
    reads = [check_reads(inv, main, "trunk"), check_reads(inv, mtp, mtp_file)]
    caches = [check_caches(derived_caches(inv, params, "main"), main),
              check_caches(derived_caches(inv, params, "mtp"), mtp)]
    return {"layout": inv.layout, "params": main.params, "reads": reads, "caches": caches,
            "reads_equal": all(r["equal"] for r in reads),
            "caches_equal": all(c["equal"] for c in caches),
            "upstream_cache_log": {"main": main.cache_log(), "mtp": mtp.cache_log()}}


# -- real-scale table check (child process) -----------------------------------------------

_TABLE_CHILD = r"""
import json, sys
from mtplib.runtime.lib import load
llama, _ = load()
out = []
for path, load_mtp in json.loads(sys.argv[1]):
    mp = llama.llama_model_default_params()
    mp.no_alloc = True   # metadata only: no weight is read or allocated
    mp.load_mode = 0     # LLAMA_LOAD_MODE_NONE: no_alloc must not mmap
    mp.lazy_mode = 0
    mp.load_mtp = load_mtp
    m = llama.llama_model_load_from_file(path.encode(), mp)
    if not m:
        out.append({"path": path, "loaded": False})
        continue
    out.append({"path": path, "loaded": True, "load_mtp": load_mtp,
                "model_size": int(llama.llama_model_size(m)),
                "n_params": int(llama.llama_model_n_params(m)),
                "n_layer": int(llama.llama_model_n_layer(m))})
    llama.llama_model_free(m)
print(json.dumps(out))
"""


def table_check(inv: Inventory, timeout: float = 120) -> list[dict]:
    """Ask upstream to load each file's tensor table with no_alloc (metadata only: no
    weight is read, nothing is allocated) in a child process, and compare the model size
    it computes with the inventory's bytes. Safe on weight-less files: no decode."""
    files = [(inv.paths["trunk"], inv.layout == "combined")]
    if inv.layout == "pair":
        files.append((inv.paths["mtp"], True))
    r = subprocess.run([sys.executable, "-c", _TABLE_CHILD, json.dumps(files)],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stderr or "").strip().splitlines()[-3:]
        raise UpstreamError(f"upstream's no_alloc load failed (exit {r.returncode}): "
                            + " | ".join(tail))
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for row, (path, _) in zip(out, files, strict=True):
        file = "trunk" if path == inv.paths["trunk"] else "mtp"
        derived = sum(t.bytes for t in inv.tensors if t.file == file)
        row.update(file=file, derived_bytes=derived,
                   equal=row.get("loaded", False) and row.get("model_size") == derived)
    return out
