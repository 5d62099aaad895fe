"""Who owns what in a distributed DeepSeek-V4 + MTP deployment, derived from GGUF headers.

Inputs are GGUF headers only (no weight reads, no llama.cpp): a trunk and its `mtp-`
sidecar, or one file holding both. Outputs, all typed and JSON-serialisable:

* every tensor's **role** (head, main_layer, tail, mtp), the **graphs that read it**
  (main, mtp, both, or none: shipped but never read) and its **shard** under a plan of
  contiguous layer ranges (the first shard holds the head, the last the tail and the MTP);
* per shard: bytes held, the **replicas** it needs beyond its own range (the token
  embedding the MTP block reads on the tail shard) and the **caches** it allocates
  (raw SWA K, CSA/HCA compressed K, indexer K, compressor states, MTP K) for a context;
* the seam bytes per token of the typed MTP contract (mtplib.contract.seam).

The read rules and cache formulas restate upstream's source at the pinned commit
(src/models/deepseek4.cpp load_arch_tensors/graph/graph_mtp, src/llama-kv-cache-dsv4.cpp,
src/llama-kv-cache-iswa.cpp, src/llama-kv-cache.cpp, src/llama-context.cpp); they are not
trusted: mtplib.runtime.graph_reads records what upstream's graphs read and allocate on
the fixtures and tests/test_graph_reads.py compares the two.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtplib.contract.seam import seam_bytes_per_token
from mtplib.contract.types import CacheKind, DType, ModelDims
from mtplib.errors import InputError
from mtplib.model.arch import ROOT_HC_HEAD, V4Config, config_from_keys, ggml_nbytes
from mtplib.model.gguf_header import (
    GGUFHeader,
    ModelFileError,
    block_of,
    read_header_fast,
    require_deepseek4,
)
from mtplib.model.validate import validate_header
from mtplib.ownership.plan import PlanError, ShardPlan, parse_plan

ROLES = ("head", "main_layer", "tail", "mtp")
GRAPHS = ("main", "mtp")
FILES = ("trunk", "mtp")
HEAD_TENSORS = ("token_embd.weight",)
TAIL_TENSORS = ("output_norm.weight", "output.weight") + tuple(f"{n}.weight" for n in ROOT_HC_HEAD)
#: Read only for embedding (vision) input, never by a text decode (deepseek4.cpp).
VISION_ONLY_SUFFIX = ".exp_probs_b_vl.bias"
#: Root tensors an `mtp-` sidecar ships as copies of the trunk's (converter: same source
#: tensors embed/head/norm). Its output_hc_* is NOT a copy: it is the MTP's own hc head.
SHARED_ROOT = ("token_embd.weight", "output.weight", "output_norm.weight")
CPU_TENSOR_ALIGNMENT = 32  # ggml TENSOR_ALIGNMENT: CPU buffer alignment per tensor
DSV4_CSA, DSV4_HCA = 4, 128


# ---------------------------------------------------------------------------------------
# 1. Inventory: headers -> typed tensor records
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the model as a shard plan sees it (shard is None before a plan)."""

    file: str  # "trunk" (the model file, combined or not) or "mtp" (the sidecar)
    name: str
    role: str  # head | main_layer | tail | mtp
    block: int | None
    shape: tuple[int, ...]  # ggml ne
    dtype: str
    bytes: int
    read_by: tuple[str, ...]  # subset of GRAPHS, () = shipped but never read
    shard: int | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["read_by"] = list(self.read_by)
        return d


@dataclass(frozen=True)
class Inventory:
    """Typed tensor records of a trunk (+ sidecar) plus the model's hyper-parameters."""

    config: V4Config
    layout: str  # "pair" (trunk + mtp- sidecar), "combined" (one file), "trunk" (no MTP)
    paths: dict[str, str]
    tensors: tuple[TensorInfo, ...]

    @property
    def has_mtp(self) -> bool:
        return self.layout in ("pair", "combined")

    def model_json(self) -> dict:
        cfg = self.config.to_dict()
        return {"layout": self.layout, "files": dict(self.paths), **cfg,
                "n_tensors": len(self.tensors),
                "bytes": {f: sum(t.bytes for t in self.tensors if t.file == f)
                          for f in FILES if any(t.file == f for t in self.tensors)}}


def _main_reads(names: set[str], cfg: V4Config) -> set[str]:
    """Weights the main (target) graph reads: the embedding, every trunk block, the tail."""
    out = {n for n in HEAD_TENSORS + TAIL_TENSORS if n in names}
    for n in names:
        b = block_of(n)
        if b is not None and b < cfg.n_layer and not n.endswith(VISION_ONLY_SUFFIX):
            out.add(n)
    return out


def _mtp_reads(names: set[str], cfg: V4Config) -> set[str]:
    """Weights graph_mtp reads from the file loaded with load_mtp (nextn offset 0):
    block n_layer (all of it), the file's root hc head, and token_embd / output_norm /
    output unless the block ships nextn.embed_tokens / shared_head_norm / shared_head_head.
    """
    L = cfg.n_layer
    pre = f"blk.{L}."
    out = {n for n in names if n.startswith(pre) and not n.endswith(VISION_ONLY_SUFFIX)}
    out |= {f"{n}.weight" for n in ROOT_HC_HEAD if f"{n}.weight" in names}
    for root, override in (("token_embd.weight", "nextn.embed_tokens.weight"),
                           ("output_norm.weight", "nextn.shared_head_norm.weight"),
                           ("output.weight", "nextn.shared_head_head.weight")):
        if pre + override not in names and root in names:
            out.add(root)
    return out


def _role(name: str, block: int | None, cfg: V4Config, file: str) -> str:
    if file == "mtp":
        return "mtp"
    if block is not None:
        return "main_layer" if block < cfg.n_layer else "mtp"
    return "head" if name in HEAD_TENSORS else "tail"


def _embd_sample(h: GGUFHeader, n: int = 4096) -> bytes:
    """8 KB of token_embd (start and middle): tells apart a sidecar converted from other
    weights without reading a tensor (a weight-less file reads as zeros, consistently)."""
    t = h.tensor("token_embd.weight")
    if t is None:
        raise ModelFileError(f"{h.path}: no token_embd.weight")
    out = b""
    with open(h.path, "rb") as f:
        for frac in (0.0, 0.5):
            f.seek(t.offset + int(t.nbytes * frac) // 4096 * 4096)
            out += f.read(min(n, t.nbytes))
    return out


def inventory(model: GGUFHeader, mtp: GGUFHeader | None = None) -> Inventory:
    """Typed records of a trunk and its sidecar, or of one file that holds both.

    Each header is validated first (model/validate.py): a file upstream would refuse or
    abort on gets a one-line ModelFileError here too, never a derivation from bad numbers.
    """
    require_deepseek4(model)
    validate_header(model)
    if mtp is not None:
        require_deepseek4(mtp)
        validate_header(mtp)
    if model.is_mtp_only:
        raise ModelFileError(f"{model.path} is an MTP sidecar, not a trunk; pass it as --mtp")
    cfg = config_from_keys(model.kv, model.n_vocab)
    if mtp is not None:
        if not mtp.is_mtp_only:
            raise ModelFileError(f"{mtp.path} is not an MTP sidecar (needs "
                                 "nextn_predict_layers > 0 and no trunk blocks)")
        side_cfg = config_from_keys(mtp.kv, mtp.n_vocab)
        if side_cfg.n_layer != cfg.n_layer or side_cfg.n_embd != cfg.n_embd \
                or side_cfg.n_vocab != cfg.n_vocab:
            raise ModelFileError(
                f"{mtp.path} is not the MTP sidecar of {model.path}: sidecar expects "
                f"{side_cfg.n_layer} layers / n_embd {side_cfg.n_embd} / vocab "
                f"{side_cfg.n_vocab}, trunk has {cfg.n_layer} / {cfg.n_embd} / {cfg.n_vocab}")
        if _embd_sample(model) != _embd_sample(mtp):
            raise ModelFileError(f"{mtp.path} is not the MTP sidecar of {model.path}: their "
                                 "token_embd data differ (different weights)")
        cfg, layout = side_cfg, "pair"  # the sidecar's config counts the MTP block
    else:
        layout = "combined" if cfg.n_mtp > 0 else "trunk"
    names_model = model.names()
    reads: dict[tuple[str, str], set[str]] = {}
    main = _main_reads(names_model, cfg)
    if layout == "pair":
        mtp_r = _mtp_reads(mtp.names(), cfg)
    elif layout == "combined":
        mtp_r = _mtp_reads(names_model, cfg)
    else:
        mtp_r = set()
    reads["trunk"] = {"main": main, "mtp": mtp_r if layout == "combined" else set()}
    if layout == "pair":
        reads["mtp"] = {"main": set(), "mtp": mtp_r}
    recs = []
    files = [("trunk", model)] + ([("mtp", mtp)] if layout == "pair" else [])
    for fname, h in files:
        for t in h.tensors:
            rb = tuple(g for g in GRAPHS if t.name in reads[fname][g])
            recs.append(TensorInfo(fname, t.name, _role(t.name, t.block, cfg, fname), t.block,
                                   t.ne, t.dtype, t.nbytes, rb))
    paths = {"trunk": str(model.path)}
    if layout == "pair":
        paths["mtp"] = str(mtp.path)
    return Inventory(cfg, layout, paths, tuple(recs))


def inventory_from_paths(model: str | Path, mtp: str | Path | None = None) -> Inventory:
    """Headers read with read_header_fast, then `inventory`."""
    return inventory(read_header_fast(model), read_header_fast(mtp) if mtp else None)


# ---------------------------------------------------------------------------------------
# 2. Shard plans
# ---------------------------------------------------------------------------------------

def balanced_plan(inv: Inventory, n_shards: int) -> ShardPlan:
    """Contiguous ranges minimising the largest shard's bytes (head on the first shard,
    tail and MTP on the last), by dynamic programming over the layer boundaries."""
    n = inv.config.n_layer
    if not 1 <= n_shards <= n:
        raise PlanError(f"n_shards must be in 1..{n}, got {n_shards}")
    layer = [0] * n
    head = last = 0
    for t in inv.tensors:
        if t.role == "main_layer":
            layer[t.block] += t.bytes
        elif t.role == "head":
            head += t.bytes
        else:
            last += t.bytes
    pre = [0]
    for b in layer:
        pre.append(pre[-1] + b)

    def cost(a: int, b: int, k: int) -> int:  # layers a..b on shard k
        c = pre[b + 1] - pre[a]
        return c + (head if k == 0 else 0) + (last if k == n_shards - 1 else 0)

    INF = float("inf")
    # best[k][j]: minimal max bytes placing layers 0..j-1 on shards 0..k-1
    best = [[INF] * (n + 1) for _ in range(n_shards + 1)]
    cut = [[0] * (n + 1) for _ in range(n_shards + 1)]
    best[0][0] = 0
    for k in range(1, n_shards + 1):
        for j in range(k, n - (n_shards - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], cost(i, j - 1, k - 1))
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    ranges, j = [], n
    for k in range(n_shards, 0, -1):
        i = cut[k][j]
        ranges.append((i, j - 1))
        j = i
    return ShardPlan(tuple(reversed(ranges)), n)


# ---------------------------------------------------------------------------------------
# 3. Caches (state ownership): what upstream allocates per layer for a context
# ---------------------------------------------------------------------------------------

KV_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


@dataclass(frozen=True)
class CacheParams:
    """Context parameters the cache sizes depend on (llama_context_params names).

    n_ctx is the context upstream is given for all sequences together (as llama_context's
    n_ctx); swa_full defaults to True like llama_context_default_params (the C API); the
    `common`/server default is False. kv_unified is False (the C default); DSV4 caches
    keep one stream per sequence in any case.
    """

    n_ctx: int = 4096
    n_seq: int = 1
    n_batch: int = 512
    n_ubatch: int = 512
    type_k: str = "f16"
    swa_full: bool = True
    n_rs_seq: int = 0

    def __post_init__(self) -> None:
        errs = []
        for k in ("n_ctx", "n_seq", "n_batch", "n_ubatch"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                errs.append(f"{k} must be an int >= 1, got {v!r}")
        if not isinstance(self.n_rs_seq, int) or self.n_rs_seq < 0:
            errs.append(f"n_rs_seq must be an int >= 0, got {self.n_rs_seq!r}")
        if self.type_k not in KV_TYPES:
            errs.append(f"type_k must be one of {sorted(KV_TYPES)}, got {self.type_k!r}")
        if errs:
            raise InputError("bad cache params: " + "; ".join(errs))

    def effective(self) -> dict:
        """What llama_context derives (llama-context.cpp): padded n_ctx, per-seq n_ctx_seq,
        and the n_batch / n_ubatch clamps."""
        n_ctx = _pad(self.n_ctx, 256)
        n_ctx_seq = _pad(n_ctx // self.n_seq, 256)
        if n_ctx_seq == 0:
            raise InputError("n_ctx_seq == 0 (upstream refuses the context)")
        n_ctx = n_ctx_seq * self.n_seq
        n_batch = min(n_ctx, self.n_batch)
        n_ubatch = min(n_batch, self.n_ubatch)
        return {"n_ctx": n_ctx, "n_ctx_seq": n_ctx_seq, "n_batch": n_batch,
                "n_ubatch": n_ubatch}


@dataclass(frozen=True)
class CacheTensor:
    """One tensor of a cache upstream allocates (name as upstream names it)."""

    context: str  # "main" (target context) or "mtp" (LLAMA_CONTEXT_TYPE_MTP)
    cache: str  # upstream cache object: raw_swa, csa, hca, lid, *_state, mtp_swa
    kind: str  # mtplib.contract CacheKind value
    part: str  # k, v, kv, score
    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    read: bool = True  # False: allocated but never read by the graph (the MTP V cache)

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def cache_tensors(cfg: V4Config, params: CacheParams, *, context: str,
                  layers: Iterable[int] | None = None) -> list[CacheTensor]:
    """Every cache tensor upstream creates for ``context`` over ``layers`` (default: all).

    main context (llama_kv_cache_dsv4): one raw SWA K cache over every block the model
    has (n_layer_all: a combined file's MTP block too, allocated but never read), K only;
    CSA compressed K and indexer K over ratio-4 layers, HCA compressed K over ratio-128
    layers, each with PAD(max(1, ceil(n_ctx_seq / ratio)), 256) cells; compressor
    states (F32 kv + score, n_seq * (1 + n_rs_seq) planes) csa: 2D x 8, hca: D x 128,
    lid: 2Di x 8 per layer.
    mtp context (llama_kv_cache_iswa filtered to blocks >= n_layer): K and V over the MTP
    block; V is allocated (the model's hparams are not K-only) but the graph reads K only.
    Raw/MTP SWA cells: n_ctx_seq if swa_full, else PAD(min(n_ctx_seq, n_swa + n_ubatch), 256).
    """
    if context not in ("main", "mtp"):
        raise InputError(f"context must be 'main' or 'mtp', got {context!r}")
    e = params.effective()
    n_ctx_seq, n_ubatch, S = e["n_ctx_seq"], e["n_ubatch"], params.n_seq
    D, Di = cfg.head_dim, cfg.indexer_dim
    tk = KV_TYPES[params.type_k]
    swa_cells = n_ctx_seq if params.swa_full else _pad(
        min(n_ctx_seq, cfg.sliding_window + n_ubatch), 256)
    out: list[CacheTensor] = []

    def k(cache: str, kind: CacheKind, part: str, il: int, width: int, cells: int,
          dtype: str = tk, read: bool = True) -> None:
        ne = (width, cells, S)
        out.append(CacheTensor(context, cache, kind.value, part, il, f"cache_{part}_l{il}", ne,
                               dtype, ggml_nbytes(dtype, ne), read))

    def state(name: str, il: int, width: int, rows: int) -> None:
        planes = S * (1 + params.n_rs_seq)
        for part in ("kv", "score"):
            ne = (width, rows, planes)
            out.append(CacheTensor(context, f"{name}_state", CacheKind.COMPRESSOR_STATE.value,
                                   part, il, f"dsv4_{name}_state_{part}_l{il}", ne, "F32",
                                   ggml_nbytes("F32", ne)))

    if context == "main":
        n_all = cfg.n_blocks if cfg.n_mtp else cfg.n_layer
        wanted = set(range(n_all)) if layers is None else set(layers)
        for il in sorted(wanted & set(range(n_all))):
            # a combined file's MTP block gets a raw K too (the cache spans n_layer_all
            # blocks); the main graph never reads it
            k("raw_swa", CacheKind.RAW_SWA_K, "k", il, D, swa_cells, read=il < cfg.n_layer)
        for il in sorted(wanted & set(range(n_all))):
            r = cfg.compress_ratios[il]
            if r == DSV4_CSA:
                k("csa", CacheKind.CSA_COMPRESSED_K, "k", il, D,
                  _pad(max(1, -(-n_ctx_seq // DSV4_CSA)), 256))
        for il in sorted(wanted & set(range(n_all))):
            if cfg.compress_ratios[il] == DSV4_HCA:
                k("hca", CacheKind.HCA_COMPRESSED_K, "k", il, D,
                  _pad(max(1, -(-n_ctx_seq // DSV4_HCA)), 256))
        for il in sorted(wanted & set(range(n_all))):
            if cfg.compress_ratios[il] == DSV4_CSA:
                k("lid", CacheKind.INDEXER_K, "k", il, Di,
                  _pad(max(1, -(-n_ctx_seq // DSV4_CSA)), 256))
        for il in sorted(wanted & set(range(n_all))):
            if cfg.compress_ratios[il] == DSV4_CSA:
                state("csa", il, 2 * D, 2 * DSV4_CSA)
        for il in sorted(wanted & set(range(n_all))):
            if cfg.compress_ratios[il] == DSV4_HCA:
                state("hca", il, D, DSV4_HCA)
        for il in sorted(wanted & set(range(n_all))):
            if cfg.compress_ratios[il] == DSV4_CSA:
                state("lid", il, 2 * Di, 2 * DSV4_CSA)
    else:
        if not cfg.n_mtp:
            return out
        mtp_layers = range(cfg.n_layer, cfg.n_blocks)
        wanted = set(mtp_layers) if layers is None else set(layers)
        for il in sorted(wanted & set(mtp_layers)):
            k("mtp_swa", CacheKind.MTP_SWA_K, "k", il, D, swa_cells)
            k("mtp_swa", CacheKind.MTP_SWA_K, "v", il, D, swa_cells, read=False)
    return out


def cache_buffers(tensors: Iterable[CacheTensor],
                  alignment: int = CPU_TENSOR_ALIGNMENT) -> dict[tuple[str, str], int]:
    """Bytes of each cache buffer: (context, cache) -> sum of tensor sizes padded to the
    buffer type's alignment (ggml_backend_alloc_ctx_tensors_from_buft)."""
    out: dict[tuple[str, str], int] = {}
    for t in tensors:
        key = (t.context, t.cache)
        out[key] = out.get(key, 0) + _pad(t.bytes, alignment)
    return out


CACHE_SUMMARY_KEYS = ("raw_swa_k", "csa_compressed_k", "hca_compressed_k", "indexer_k",
                      "compressor_state", "mtp_swa_k", "mtp_swa_v_unread", "raw_swa_k_unread")


def _summary_key(t: CacheTensor) -> str:
    """Allocated-but-unread tensors get their own keys: the MTP context's V cache, and the
    main context's raw K of a combined file's MTP block."""
    if t.read:
        return t.kind
    return "mtp_swa_v_unread" if t.cache == "mtp_swa" else f"{t.kind}_unread"


def cache_summary(tensors: Iterable[CacheTensor]) -> dict[str, int]:
    out = dict.fromkeys(CACHE_SUMMARY_KEYS, 0)
    for t in tensors:
        out[_summary_key(t)] += t.bytes
    out["total"] = sum(out[k] for k in CACHE_SUMMARY_KEYS)
    return out


# ---------------------------------------------------------------------------------------
# 4. Ownership: plan + inventory + params -> per-tensor shards, per-shard bytes/replicas
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    index: int
    layers: tuple[int, int]
    bytes: int  # bytes of the tensors this shard holds (from its files)
    bytes_by_role: dict[str, int]
    unread_bytes: int  # held but read by no graph
    holds_mtp: bool
    replicas: tuple[dict, ...]  # tensors read here whose owning range is another shard
    replica_bytes: int
    copy_bytes: int  # replica bytes no held file provides (must be copied to this shard)
    duplicates: tuple[dict, ...]  # the same logical tensor held twice on this shard
    duplicate_bytes: int
    caches: dict[str, int]  # cache bytes by kind (CACHE_SUMMARY_KEYS + total)

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["replicas"] = list(self.replicas)
        d["duplicates"] = list(self.duplicates)
        return d


@dataclass(frozen=True)
class Ownership:
    inventory: Inventory
    plan: ShardPlan
    params: CacheParams
    tensors: tuple[TensorInfo, ...]
    shards: tuple[Shard, ...]
    caches: tuple[CacheTensor, ...] = field(repr=False)

    @property
    def mtp_block_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors if t.role == "mtp" and t.block is not None)

    def seam_bytes(self) -> dict:
        """Per-token bytes crossing one seam (mtplib.contract.seam), for f32 and bf16 rows;
        a pipeline of n shards has n-1 seams."""
        cfg = self.inventory.config
        dims = ModelDims(n_embd=cfg.n_embd, n_vocab=cfg.n_vocab)
        return {"n_seams": self.plan.n_shards - 1,
                "per_seam": {d.value: seam_bytes_per_token(dims, d)
                             for d in (DType.F32, DType.BF16)}}

    def to_json(self, *, tensors: bool = True) -> dict:
        out = {"model": {**self.inventory.model_json(), "plan": str(self.plan),
                         "mtp_block_bytes": self.mtp_block_bytes,
                         "cache_params": {**asdict(self.params), **self.params.effective()}}}
        if tensors:
            out["tensors"] = [t.to_json() for t in self.tensors]
        out["shards"] = [s.to_json() for s in self.shards]
        out["seam_bytes_per_token"] = self.seam_bytes()
        return out


def _logical(t: TensorInfo) -> str:
    """Identity of the data a tensor holds: a sidecar's token_embd/output/output_norm are
    copies of the trunk's; everything else is its own tensor."""
    if t.file == "mtp" and t.name in SHARED_ROOT:
        return "trunk:" + t.name
    return f"{t.file}:{t.name}"


def derive(inv: Inventory, plan: ShardPlan | str | None = None,
           params: CacheParams | None = None) -> Ownership:
    """Assign every tensor and cache to a shard of ``plan`` (default: one shard)."""
    cfg = inv.config
    if plan is None:
        plan = ShardPlan(((0, cfg.n_layer - 1),), cfg.n_layer)
    elif isinstance(plan, str):
        plan = parse_plan(plan, cfg.n_layer)
    elif plan.n_layer != cfg.n_layer:
        raise PlanError(f"plan is for {plan.n_layer} layers, the model has {cfg.n_layer}")
    params = params or CacheParams()
    last = plan.n_shards - 1

    def home(t: TensorInfo) -> int:
        if t.role == "head":
            return 0
        if t.role == "main_layer":
            return plan.shard_of(t.block)
        return last

    tensors = tuple(TensorInfo(**{**asdict(t), "shard": home(t)}) for t in inv.tensors)
    # owner shard of each logical tensor = where its (trunk) record lives
    owner = {}
    for t in tensors:
        if t.file == "trunk":
            owner[_logical(t)] = t.shard
    for t in tensors:
        owner.setdefault(_logical(t), t.shard)

    # where each read happens: main-graph parts on the shard owning them, MTP on the last
    def needed_on(t: TensorInfo) -> set[int]:
        s = set()
        if "main" in t.read_by:
            s.add(home(t))
        if "mtp" in t.read_by:
            s.add(last)
        return s

    caches = cache_tensors(cfg, params, context="main") if cfg.n_layer else []
    if inv.layout == "pair":  # the trunk file has no MTP block: main caches stop at n_layer
        caches = [c for c in caches if c.layer < cfg.n_layer]
    if inv.has_mtp:
        caches += cache_tensors(cfg, params, context="mtp")

    def cache_shard(c: CacheTensor) -> int:
        return plan.shard_of(c.layer) if c.layer < cfg.n_layer else last

    shards = []
    for i, (a, b) in enumerate(plan.ranges):
        held = [t for t in tensors if t.shard == i]
        by_role = {r: sum(t.bytes for t in held if t.role == r) for r in ROLES}
        held_logical: dict[str, list[TensorInfo]] = {}
        for t in held:
            held_logical.setdefault(_logical(t), []).append(t)
        replicas = []
        seen = set()
        for t in tensors:
            key = _logical(t)
            if i in needed_on(t) and owner[key] != i and key not in seen:
                seen.add(key)
                provided = next((h for h in held_logical.get(key, [])), None)
                replicas.append({
                    "name": t.name, "file": t.file, "bytes": t.bytes, "owner_shard": owner[key],
                    "read_by": list(t.read_by),
                    "provided_by": (f"{provided.file} file on this shard" if provided
                                    else f"copy from shard {owner[key]}")})
        dups = []
        for ts in held_logical.values():
            if len(ts) > 1:
                for t in ts[1:]:
                    dups.append({"name": t.name, "file": t.file, "bytes": t.bytes,
                                 "duplicate_of": f"{ts[0].file}:{ts[0].name}",
                                 "read_by": list(t.read_by)})
        my_caches = [c for c in caches if cache_shard(c) == i]
        shards.append(Shard(
            index=i, layers=(a, b), bytes=sum(t.bytes for t in held), bytes_by_role=by_role,
            unread_bytes=sum(t.bytes for t in held if not t.read_by),
            holds_mtp=inv.has_mtp and i == last,
            replicas=tuple(replicas), replica_bytes=sum(r["bytes"] for r in replicas),
            copy_bytes=sum(r["bytes"] for r in replicas if r["provided_by"].startswith("copy")),
            duplicates=tuple(dups), duplicate_bytes=sum(d["bytes"] for d in dups),
            caches=cache_summary(my_caches)))
    return Ownership(inv, plan, params, tensors, tuple(shards), tuple(caches))
