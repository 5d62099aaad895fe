"""What a shard receives per step besides the seam (`mtplib.lab.projection`): the rotation
matrices, the per-step graph inputs (masks, positions, compressor indices) and the MTP
context's inputs, each sized as upstream builds it at the pin.

Why apart: these follow upstream's graph code line by line (src/llama-graph.cpp,
src/llama-kv-cache*.cpp), so they change only when the pin does.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplib.errors import InputError
from mtplib.lab.projection.constants import QUANTIZED_K, pad_to
from mtplib.lab.projection.params import ProjectionParams
from mtplib.model.arch import HC, V4Config
from mtplib.ownership.derivation import DSV4_CSA, DSV4_HCA, KV_TYPES, CacheParams
from mtplib.ownership.plan import ShardPlan


# -- the indexer's rotation matrix ---------------------------------------------------------
def hadamard_side(head_size: int) -> int:
    """Side of the Hadamard matrix upstream uploads as ``attn_inp_k_rot`` for a cache of
    head size ``head_size`` (src/llama-kv-cache.cpp build_input_k_rot at the pin): the
    largest power of two dividing it, found by doubling from 128, and 64 when 128 does not
    divide it (the loop starts at 64 and always doubles once)."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        raise InputError(f"head size must be an int >= 1, got {head_size!r}")
    nrot = 64
    while True:
        nrot *= 2
        if head_size % nrot:
            break
    return nrot // 2


def rotation_constants(cfg: V4Config, type_k: str = "f16") -> dict[str, int]:
    """Bytes of each F32 rotation matrix upstream re-uploads on every graph, by the cache
    that owns it (a shard receives one when it holds a layer of that cache).

    Upstream (llama_kv_cache constructor) turns rotation on for a cache when its K type is
    quantized and its head size is a multiple of 64, and always for the DeepSeek lightning
    indexer (the `lid` cache: head size = indexer key length). V4's raw / CSA / HCA caches
    have head size head_dim (K only)."""
    if type_k not in KV_TYPES:
        raise InputError(f"type_k must be one of {sorted(KV_TYPES)}, got {type_k!r}")
    out = {"lid": hadamard_side(cfg.indexer_dim) ** 2 * 4}
    if type_k in QUANTIZED_K and cfg.head_dim % 64 == 0:
        side = hadamard_side(cfg.head_dim) ** 2 * 4
        out.update({"raw": side, "csa": side, "hca": side})
    return out


# -- plans and shards ----------------------------------------------------------------------
@dataclass(frozen=True)
class ShardRole:
    """What a shard's layer range implies for the messages it gets."""

    index: int
    layers: tuple[int, int]
    first: bool
    last: bool
    has_csa: bool
    has_hca: bool
    has_hash: bool


def shard_roles(cfg: V4Config, plan: ShardPlan) -> list[ShardRole]:
    out = []
    for i, (a, b) in enumerate(plan.ranges):
        rs = cfg.compress_ratios[a:b + 1]
        out.append(ShardRole(i, (a, b), i == 0, i == plan.n_shards - 1, DSV4_CSA in rs,
                             DSV4_HCA in rs, a < cfg.n_hash_layers))
    return out


# -- per-step graph inputs (src/llama-graph.cpp, src/llama-kv-cache*.cpp at the pin) -------
def n_kv_raw(cfg: V4Config, params: ProjectionParams, context: int) -> int:
    """Width of the raw SWA mask: llama_kv_cache::get_n_kv = min(cells, max(256,
    PAD(used_max_p1, 256))); one sequence fills cells in order, so used_max_p1 = context
    until the ring wraps (swa_full: n_ctx_seq cells; else PAD(min(n_ctx_seq, n_swa +
    n_ubatch), 256))."""
    e = CacheParams(n_ctx=params.n_ctx, n_ubatch=params.n_ubatch).effective()
    cells = e["n_ctx_seq"] if params.swa_full else pad_to(
        min(e["n_ctx_seq"], cfg.sliding_window + e["n_ubatch"]), 256)
    return min(cells, max(256, pad_to(context, 256)))


def n_kv_comp(ratio: int, context: int) -> int:
    """Width of a compressed mask (dsv4_build_comp_plan): max(PAD(max n_visible, 256), 256)
    with n_visible = (pos + 1) / ratio."""
    return max(pad_to(context // ratio, 256), 256)


def state_index_inputs(name: str, ratio: int, n_tok: int, n_rs_seq: int) -> dict[str, int]:
    """The I32/I64 index tensors of one compressor per ubatch of one sequence
    (dsv4_build_comp_plan; a tensor of size 0 is not built): state_pos; persist src/dst
    (one per state row touched); read (2*ratio per block for the overlapping CSA/indexer
    compressor, ratio for HCA); write idx (I64) and pos, one per block, at least one (the
    dummy block); restore src/dst (state rows) and snapshot src/dst (n_rs_seq planes of
    them) when n_rs_seq > 0."""
    state = 2 * ratio if ratio == DSV4_CSA else ratio
    reads = 2 * ratio if ratio == DSV4_CSA else ratio
    blocks = max(1, -(-n_tok // ratio))
    p = f"dsv4_{name}_state_"
    d = {p + "pos": 4 * n_tok, p + "persist_src_idxs": 4 * min(n_tok, state),
         p + "persist_dst_idxs": 4 * min(n_tok, state), p + "read_idxs": 4 * blocks * reads,
         p + "write_idxs": 8 * blocks, p + "write_pos": 4 * blocks}
    if n_rs_seq:
        d.update({p + "restore_src_idxs": 4 * state, p + "restore_dst_idxs": 4 * state,
                  p + "snapshot_src_idxs": 4 * n_rs_seq * state,
                  p + "snapshot_dst_idxs": 4 * n_rs_seq * state})
    return d


def graph_inputs(cfg: V4Config, role: ShardRole, params: ProjectionParams, *, n_tok: int,
                 n_out: int, n_rs_seq: int, context: int | None = None) -> dict[str, int]:
    """Bytes of every per-step graph input one shard receives for a trunk pass of ``n_tok``
    tokens (one entry per tensor, named as upstream names it: each is one SET_TENSOR).
    Masks are n_kv x n_tokens (no padding of n_tokens at the pin); F16 with flash
    attention (the indexer's with the fused indexer), else F32. out_ids is always built at
    the pin (build_inp_out_ids), so the tail always gets it."""
    L = params.context if context is None else context
    m = 2 if params.flash_attn else 4
    m_lid = 2 if params.fused_lid else 4
    d = {"inp_pos": 4 * n_tok, "attn_inp_k_idxs": 8 * n_tok,
         "attn_inp_kq_mask": n_kv_raw(cfg, params, L) * n_tok * m}
    if role.first:  # token_embd lives on the client's CPU: its rows are an input here
        d["inp_embd"] = cfg.n_embd * 4 * n_tok
    if role.has_hash:
        d["inp_tokens"] = 4 * n_tok
    if role.last:
        d["out_ids"] = 4 * n_out
    if role.has_csa:
        d["dsv4_csa_kq_mask"] = n_kv_comp(DSV4_CSA, L) * n_tok * m
        d.update(state_index_inputs("csa", DSV4_CSA, n_tok, n_rs_seq))
        d["dsv4_lid_kq_mask"] = n_kv_comp(DSV4_CSA, L) * n_tok * m_lid
        d.update(state_index_inputs("lid", DSV4_CSA, n_tok, n_rs_seq))
    if role.has_hca:
        d["dsv4_hca_kq_mask"] = n_kv_comp(DSV4_HCA, L) * n_tok * m
        d.update(state_index_inputs("hca", DSV4_HCA, n_tok, n_rs_seq))
    return d


def constants(cfg: V4Config, role: ShardRole, params: ProjectionParams) -> dict[str, int]:
    """Constant tensors re-sent to one shard on every step: the rotation matrices of the
    caches it holds layers of (``attn_inp_k_rot``)."""
    rot = rotation_constants(cfg, params.type_k)
    out = {}
    if "raw" in rot:
        out["attn_inp_k_rot(raw)"] = rot["raw"]
    if role.has_csa:
        out["attn_inp_k_rot(lid)"] = rot["lid"]
        if "csa" in rot:
            out["attn_inp_k_rot(csa)"] = rot["csa"]
    if role.has_hca and "hca" in rot:
        out["attn_inp_k_rot(hca)"] = rot["hca"]
    return out


MTP_INPUT_TENSORS = 7  # tokens, positions, K and V slot indices, SWA mask, embd rows, out_ids


def mtp_input_bytes(cfg: V4Config, params: ProjectionParams, n_tok: int) -> int:
    """One MTP-context decode of n_tok rows on the tail: token ids, positions, K and V slot
    indices (its cache is an ordinary iswa cache with V allocated), its SWA mask, and the
    trunk rows in batch.embd (F32)."""
    m = 2 if params.flash_attn else 4
    return n_tok * (4 + 4 + 8 + 8 + HC * cfg.n_embd * 4) \
        + n_kv_raw(cfg, params, params.context) * n_tok * m
