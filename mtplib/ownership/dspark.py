"""Who owns what for a DeepSeek-V4 DSpark draft, derived from its GGUF header and the
trunk's (pure: no llama.cpp).

Outputs, typed and JSON-serialisable:

* every tensor the draft's graphs read, with its **part** (a draft stage, the feature
  fusion ``fc`` + ``enc.output_norm``, the Markov head, the confidence head, the draft's hc
  head + output norm, and the shared token embedding and output head, the trunk's through
  ``ctx_other`` unless the draft ships its own) and the **graphs that read it**: ``inject``
  (an embd batch: the target's features through ``fc`` into each stage's K) and
  ``block`` (a token batch: the noise block through the stages and both heads);
* which **trunk layers feed it** (``target_layers`` in upstream's ids + 1 convention: id t
  is the input of layer t, the output of layer t-1) and, under a shard plan, where each
  feature is made and which shards see it;
* the draft context's **caches** (each stage's SWA K, plus the V upstream allocates and
  never reads) and, per placement of the draft (the client or the tail shard), what it
  holds, the trunk tensors it needs copies of, and the feature bytes that reach it.

The read rules restate upstream's source at the pin (src/models/dflash.cpp
load_arch_tensors, graph_dsv4, build_dspark_markov_head; src/llama-model.cpp's DFLASH
memory) and are not trusted: `mtplib.runtime.dspark.graph_reads` records what upstream's
two graphs read and allocate on the fixture and tests/test_ownership_dspark.py compares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from mtplib.contract.dspark import dspark_crossings, dspark_step_bytes
from mtplib.contract.labels import Placement
from mtplib.contract.seam import seam_bytes_per_token
from mtplib.contract.types import MAX_DRAFT, CacheKind, DType, ModelDims
from mtplib.errors import InputError
from mtplib.model.arch import config_from_keys, ggml_nbytes
from mtplib.model.dspark.spec import ROOT_KINDS, DSparkConfig
from mtplib.model.dspark.validate import validate_dspark
from mtplib.model.gguf_header import GGUFHeader, read_header_fast
from mtplib.model.validate import validate_header
from mtplib.ownership.derivation import KV_TYPES, CacheParams, CacheTensor
from mtplib.ownership.plan import ShardPlan, parse_plan

DSPARK_GRAPHS = ("inject", "block")
PARTS = ("stage", "feature_fusion", "markov_head", "confidence_head", "draft_head",
         "shared_embedding", "shared_output_head")
#: root tensor kind (`mtplib.model.dspark.spec.ROOT_KINDS`) -> part
ROOT_PARTS = {
    "fc": "feature_fusion", "fc_scale": "feature_fusion", "enc_output_norm": "feature_fusion",
    "markov_w1": "markov_head", "markov_w2": "markov_head", "markov_w2_scale": "markov_head",
    "conf_proj": "confidence_head", "conf_proj_bias": "confidence_head",
    "output_norm": "draft_head", "output_hc_fn": "draft_head", "output_hc_base": "draft_head",
    "output_hc_scale": "draft_head",
    "token_embd": "shared_embedding", "output": "shared_output_head",
}
#: the embd batch's reads (dflash.cpp graph_dsv4, ``if (ubatch.embd)``): fc (+ its scale),
#: the encoder norm, and each stage's wkv and kv_norm
INJECT_ROOTS = frozenset({"fc.weight", "fc.scale", "enc.output_norm.weight"})
INJECT_STAGE_KINDS = frozenset({"attn_kv", "attn_kv_a_norm"})
#: roots the token batch never reads
NOT_IN_BLOCK = INJECT_ROOTS
SHARED = ("token_embd.weight", "output.weight")
#: the graphs each part is read by (dflash.cpp graph_dsv4): the embd batch reads the
#: feature fusion and each stage's wkv + kv_norm; the token batch everything but the fusion
PART_GRAPHS: dict[str, frozenset[str]] = {
    "stage": frozenset(DSPARK_GRAPHS), "feature_fusion": frozenset({"inject"}),
    **{p: frozenset({"block"}) for p in ("markov_head", "confidence_head", "draft_head",
                                          "shared_embedding", "shared_output_head")}}
DRAFT_CACHE_KEYS = ("dspark_swa_k", "dspark_swa_v_unread")


class DSparkOwnershipError(InputError):
    """A draft tensor no part takes, or an input the derivation cannot use."""


@dataclass(frozen=True)
class DraftTensor:
    """One tensor a DSpark draft's graphs read, or that its file holds."""

    file: str  # "dspark" (the draft file) or "trunk" (the trunk's, through ctx_other)
    name: str
    part: str  # one of PARTS
    stage: int | None
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    read_by: tuple[str, ...]  # subset of DSPARK_GRAPHS; () = held, never read

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"], d["read_by"] = list(self.shape), list(self.read_by)
        return d


@dataclass(frozen=True)
class FeatureSource:
    """Where one feature of the draft comes from: the hc-mean of the residual entering
    trunk layer ``target_layer`` (the output of layer ``target_layer - 1``; of the
    embedding for 0). ``made_on``: the shard computing that residual; ``seen_on``: the
    shards holding it (its maker, and the next layer's shard, which receives it at the
    seam as ``boundary_hidden`` and can take the mean itself: v4-dspark.md §3.2)."""

    target_layer: int
    trunk_layer: int  # -1: the embedding
    made_on: int
    seen_on: tuple[int, ...]

    def to_json(self) -> dict:
        return {**asdict(self), "seen_on": list(self.seen_on)}


@dataclass(frozen=True)
class PlacementNeeds:
    """What the draft needs where it runs (``placement``): the draft file's bytes, copies
    of trunk tensors its graphs read that are not there, the features that reach it from
    elsewhere (f32 bytes per committed token) and its caches (bytes by kind)."""

    placement: str
    holder: str
    draft_bytes: int
    replicas: tuple[dict, ...]
    replica_bytes: int
    remote_features: tuple[int, ...]
    feature_bytes_per_token: int
    caches: dict[str, int]

    def to_json(self) -> dict:
        d = asdict(self)
        d["replicas"], d["remote_features"] = list(self.replicas), list(self.remote_features)
        return d


@dataclass(frozen=True)
class DSparkOwnership:
    """A DSpark draft's ownership beside a trunk under a shard plan."""

    config: DSparkConfig
    paths: dict[str, str]
    n_layer: int
    plan: ShardPlan
    tensors: tuple[DraftTensor, ...]
    features: tuple[FeatureSource, ...]
    caches: tuple[CacheTensor, ...]
    placements: tuple[PlacementNeeds, ...]

    def parts(self) -> list[dict]:
        """Tensors and bytes by file, part and reading graphs."""
        out: dict[tuple[str, str, str], list[int]] = {}
        for t in self.tensors:
            key = (t.file, t.part, "+".join(t.read_by) or "none")
            row = out.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += t.bytes
        return [{"file": f, "part": p, "read_by": r, "tensors": n, "bytes": b}
                for (f, p, r), (n, b) in sorted(out.items())]

    def to_json(self, *, tensors: bool = True) -> dict:
        out: dict = {"draft": {**self.config.to_dict(), "files": dict(self.paths),
                               "n_tensors": sum(t.file == "dspark" for t in self.tensors),
                               "bytes": sum(t.bytes for t in self.tensors
                                            if t.file == "dspark")},
                     "n_layer": self.n_layer, "plan": str(self.plan), "parts": self.parts(),
                     "features": [f.to_json() for f in self.features],
                     "caches": [c.to_json() for c in self.caches],
                     "placements": [p.to_json() for p in self.placements]}
        if tensors:
            out["tensors"] = [t.to_json() for t in self.tensors]
        return out


def _part(name: str, stage: int | None) -> tuple[str, str]:
    """(part, kind) of a draft tensor; DSparkOwnershipError if no part takes it."""
    if stage is not None:
        rest = name.split(".", 2)[2] if name.count(".") >= 2 else ""
        return "stage", rest.rsplit(".", 1)[0]
    kind = ROOT_KINDS.get(name, (None, False))[0]
    if kind is None or kind not in ROOT_PARTS:
        raise DSparkOwnershipError(f"draft tensor {name!r} belongs to no part of a DSpark "
                                   f"draft (parts: {', '.join(PARTS)})")
    return ROOT_PARTS[kind], kind


def draft_tensors(draft: GGUFHeader, trunk: GGUFHeader) -> tuple[DraftTensor, ...]:
    """Every tensor of the draft file with its part and readers, then the trunk tensors
    its block graph reads through ``ctx_other`` (token_embd, output) where the draft has
    no copy of its own (dflash.cpp:915-923, 1011-1020; a draft with its own token_embd
    and no output reads that token_embd as its head, TENSOR_DUPLICATED)."""
    own = draft.names()
    out = []
    for t in draft.tensors:
        part, kind = _part(t.name, t.block)
        reads = []
        if t.name in INJECT_ROOTS or (t.block is not None and kind in INJECT_STAGE_KINDS):
            reads.append("inject")
        if t.name not in NOT_IN_BLOCK:
            reads.append("block")
        out.append(DraftTensor("dspark", t.name, part, t.block, t.ne, t.dtype, t.nbytes,
                               tuple(reads)))
    head_from_embd = "output.weight" not in own and "token_embd.weight" in own
    for name in SHARED:
        if name in own or (name == "output.weight" and head_from_embd):
            continue
        rec = trunk.tensor(name)
        if rec is None:
            raise DSparkOwnershipError(f"{trunk.path} has no {name}, which the DSpark draft "
                                       "reads through ctx_other")
        out.append(DraftTensor("trunk", name, _part(name, None)[0], None, rec.ne, rec.dtype,
                               rec.nbytes, ("block",)))
    return tuple(out)


def feature_sources(cfg: DSparkConfig, plan: ShardPlan) -> tuple[FeatureSource, ...]:
    """Where each of the draft's features is made and seen under ``plan``."""
    n = plan.n_layer
    out = []
    for t in cfg.target_layers:
        if not 0 <= t <= n:
            raise DSparkOwnershipError(f"target layer {t} outside 0..{n} (the trunk's layer "
                                       "inputs; n = the last layer's output)")
        made = plan.shard_of(t - 1) if t > 0 else 0
        seen = {made} | ({plan.shard_of(t)} if t < n else set())
        out.append(FeatureSource(t, t - 1, made, tuple(sorted(seen))))
    return tuple(out)


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def dspark_cache_tensors(cfg: DSparkConfig, params: CacheParams) -> list[CacheTensor]:
    """The draft context's caches (src/llama-model.cpp DFLASH: llama_kv_cache_iswa with
    every stage sliding-window, so the non-SWA part is empty): per stage a K of head_dim
    per cell and a V of the same size the DSV4 path never reads; cells n_ctx_seq with
    swa_full, else PAD(min(n_ctx_seq, n_swa + n_ubatch), 256) (llama-kv-cache-iswa.cpp)."""
    e = params.effective()
    n_ctx_seq, n_ubatch, S = e["n_ctx_seq"], e["n_ubatch"], params.n_seq
    cells = n_ctx_seq if params.swa_full else _pad(min(n_ctx_seq,
                                                       cfg.sliding_window + n_ubatch), 256)
    tk = KV_TYPES[params.type_k]
    out = []
    for il in range(cfg.n_stages):
        for part, read in (("k", True), ("v", False)):
            ne = (cfg.head_dim, cells, S)
            out.append(CacheTensor("dspark", "dspark_swa", CacheKind.DSPARK_SWA_K.value, part,
                                   il, f"cache_{part}_l{il}", ne, tk, ggml_nbytes(tk, ne), read))
    return out


def draft_cache_summary(tensors: Iterable[CacheTensor]) -> dict[str, int]:
    out = dict.fromkeys(DRAFT_CACHE_KEYS, 0)
    for t in tensors:
        out["dspark_swa_k" if t.read else "dspark_swa_v_unread"] += t.bytes
    out["total"] = sum(out[k] for k in DRAFT_CACHE_KEYS)
    return out


def placement_needs(tensors: tuple[DraftTensor, ...], features: tuple[FeatureSource, ...],
                    plan: ShardPlan, cfg: DSparkConfig, caches: dict[str, int]
                    ) -> tuple[PlacementNeeds, ...]:
    """The draft in the client, and on the tail shard (the shard of the last layer)."""
    tail = plan.n_shards - 1
    home = {"token_embd.weight": 0, "output.weight": tail}  # where the trunk keeps them
    draft_bytes = sum(t.bytes for t in tensors if t.file == "dspark")
    row = cfg.n_embd * 4
    out = []
    for placement in (Placement.CLIENT, Placement.TAIL):
        on_tail = placement == Placement.TAIL
        reps = tuple({"name": t.name, "bytes": t.bytes, "from_shard": home[t.name],
                      "read_by": list(t.read_by)} for t in tensors
                     if t.file == "trunk" and not (on_tail and home[t.name] == tail))
        remote = tuple(f.target_layer for f in features
                       if not (on_tail and tail in f.seen_on))
        out.append(PlacementNeeds(placement.value, f"shard {tail}" if on_tail else "client",
                                  draft_bytes, reps, sum(r["bytes"] for r in reps), remote,
                                  len(remote) * row, dict(caches)))
    return tuple(out)


def part_contradictions(own: DSparkOwnership, observed: Mapping[str, Iterable[str]]
                        ) -> list[str]:
    """What upstream's graphs contradict in the parts: for ``observed`` (graph -> the
    weights it read, "<file>:<name>"), each weight no derived tensor is, and each whose
    part is not one that graph reads (`PART_GRAPHS`). Empty: every read fits its part."""
    by_key = {f"{t.file}:{t.name}": t for t in own.tensors}
    out = []
    for graph, keys in sorted(observed.items()):
        for key in sorted(keys):
            t = by_key.get(key)
            if t is None:
                out.append(f"{graph} read {key}, which no part holds")
            elif graph not in PART_GRAPHS[t.part]:
                out.append(f"{graph} read {key}, of part {t.part} (read by "
                           f"{'/'.join(sorted(PART_GRAPHS[t.part]))} only)")
    return out


def crossing_table(cfg: DSparkConfig) -> dict:
    """What crosses for this draft per placement (`dspark_crossings` at its sizes: rows and
    the bytes one step of block-size drafts adds by drafts accepted) and, to compare, the
    MTP hidden row's f32 bytes per committed token; JSON-ready."""
    dims = ModelDims(n_embd=cfg.n_embd, n_vocab=cfg.n_vocab,
                     n_target_layers=len(cfg.target_layers))
    k = min(cfg.block_size, MAX_DRAFT)
    return {"target_layers": list(cfg.target_layers), "n_embd": cfg.n_embd, "k": k,
            "mtp_row_bytes": seam_bytes_per_token(dims, DType.F32)["mtp_hidden_remote"],
            "placements": {pl.value: {
                "rows": [c.to_json() for c in dspark_crossings(
                    dims, pl, n_stages=cfg.n_stages, head_dim=cfg.head_dim)],
                "step_bytes": {str(n): dspark_step_bytes(dims, pl, k, n)
                               for n in range(k + 1)}}
                for pl in (Placement.CLIENT, Placement.TAIL)}}


def tail_features(cfg: DSparkConfig, plans: Iterable[ShardPlan]) -> list[dict]:
    """Per plan, the target layers whose residual the tail shard does not see (their rows
    would come from the shard before) and their f32 bytes per committed token."""
    out = []
    for plan in plans:
        tail = plan.n_shards - 1
        remote = [f.target_layer for f in feature_sources(cfg, plan) if tail not in f.seen_on]
        out.append({"plan": str(plan), "shards": plan.n_shards,
                    "tail_first_layer": plan.ranges[-1][0], "remote_layers": remote,
                    "tail_feature_bytes_per_token": len(remote) * cfg.n_embd * 4})
    return out


def derive_dspark(draft: GGUFHeader, trunk: GGUFHeader, plan: ShardPlan | str | None = None,
                  params: CacheParams | None = None) -> DSparkOwnership:
    """The draft's ownership beside ``trunk`` under ``plan`` (default: one shard). Both
    headers are validated first (a draft upstream would refuse or abort on is refused here
    in one line, `validate_dspark`, the pairing with the trunk included)."""
    validate_header(trunk)
    cfg = validate_dspark(draft, trunk)
    n_layer = config_from_keys(trunk.kv, trunk.n_vocab).n_layer
    if plan is None:
        plan = ShardPlan(((0, n_layer - 1),), n_layer)
    elif isinstance(plan, str):
        plan = parse_plan(plan, n_layer)
    elif plan.n_layer != n_layer:
        raise DSparkOwnershipError(f"plan is for {plan.n_layer} layers, the trunk has "
                                   f"{n_layer}")
    params = params or CacheParams()
    tensors = draft_tensors(draft, trunk)
    feats = feature_sources(cfg, plan)
    caches = dspark_cache_tensors(cfg, params)
    needs = placement_needs(tensors, feats, plan, cfg, draft_cache_summary(caches))
    return DSparkOwnership(cfg, {"dspark": str(draft.path), "trunk": str(trunk.path)},
                           n_layer, plan, tensors, feats, tuple(caches), needs)


def derive_dspark_from_paths(draft: str, trunk: str, plan: ShardPlan | str | None = None,
                             params: CacheParams | None = None) -> DSparkOwnership:
    """Headers read with read_header_fast, then `derive_dspark`."""
    return derive_dspark(read_header_fast(draft), read_header_fast(trunk), plan, params)
