"""`mtplib inventory`: tensor ownership, shard plan, caches and seam bytes of a V4 model."""

from __future__ import annotations

import argparse
import json
import sys

from mtplib.commands.common import add_json_arg

#: --ctx when not given, capped by the model's context_length
DEFAULT_CTX = 4096


def _bytes(n: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*map(str, r)) for r in rows])


def render(own) -> str:
    """Readable tables: model, tensors grouped by file/role/read_by, shards, caches, seam."""
    inv = own.inventory
    cfg = inv.config
    out = [f"model: {inv.layout} layout, {cfg.n_layer} trunk layers + {cfg.n_mtp} MTP block(s), "
           f"n_embd {cfg.n_embd}, vocab {cfg.n_vocab}, plan {own.plan}"]
    for k, v in inv.paths.items():
        out.append(f"  {k}: {v}")
    groups: dict[tuple, list] = {}
    for t in own.tensors:
        groups.setdefault((t.file, t.role, "+".join(t.read_by) or "none"), []).append(t)
    rows = [[f, r, rb, len(ts), _bytes(sum(t.bytes for t in ts))]
            for (f, r, rb), ts in sorted(groups.items())]
    out += ["", "tensors (by file, role, read_by):",
            _table(rows, ["file", "role", "read_by", "tensors", "bytes"])]
    rows = [[s.index, f"{s.layers[0]}-{s.layers[1]}", _bytes(s.bytes),
             _bytes(s.bytes_by_role["head"]), _bytes(s.bytes_by_role["main_layer"]),
             _bytes(s.bytes_by_role["tail"]), _bytes(s.bytes_by_role["mtp"]),
             _bytes(s.replica_bytes), _bytes(s.caches["total"])] for s in own.shards]
    e = own.params.effective()
    out += ["", f"shards (caches for n_ctx {e['n_ctx']}, {own.params.n_seq} seq, "
            f"K {own.params.type_k}, swa_full {own.params.swa_full}):",
            _table(rows, ["shard", "layers", "bytes", "head", "main_layer", "tail", "mtp",
                          "replicas", "caches"])]
    for s in own.shards:
        for r in s.replicas:
            out.append(f"  shard {s.index} replica: {r['name']} ({r['file']}, {_bytes(r['bytes'])},"
                       f" owner shard {r['owner_shard']}, {r['provided_by']})")
        for d in s.duplicates:
            out.append(f"  shard {s.index} duplicate: {d['name']} ({d['file']}, "
                       f"{_bytes(d['bytes'])}) of {d['duplicate_of']}, read_by "
                       f"{'+'.join(d['read_by']) or 'none'}")
    keys = [k for k in own.shards[0].caches if k != "total"]
    rows = [[s.index] + [_bytes(s.caches[k]) for k in keys] for s in own.shards]
    out += ["", "caches per shard (all shard-local):", _table(rows, ["shard"] + keys)]
    seam = own.seam_bytes()
    rows = [[k] + [seam["per_seam"][d][k] for d in seam["per_seam"]]
            for k in seam["per_seam"]["f32"]]
    out += ["", f"seam bytes per token (per seam; {seam['n_seams']} seam(s)):",
            _table(rows, ["value"] + list(seam["per_seam"]))]
    out.append(f"\nMTP block bytes: {own.mtp_block_bytes} ({_bytes(own.mtp_block_bytes)})")
    return "\n".join(out)


def run(a: argparse.Namespace) -> int:
    from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths

    inv = inventory_from_paths(a.model, a.mtp)
    n_train = inv.config.n_ctx_train
    notes = []
    if a.ctx is None:
        a.ctx = min(DEFAULT_CTX, n_train) if n_train > 0 else DEFAULT_CTX
    elif 0 < n_train < a.ctx:  # sized as asked, but said: upstream refuses such a context
        notes.append(f"n_ctx {a.ctx} exceeds the model's context_length {n_train}: upstream "
                     "refuses such a context; its cache bytes are sized for the n_ctx asked")
    params = CacheParams(n_ctx=a.ctx, n_seq=a.seqs, n_ubatch=a.ubatch, type_k=a.kv_type,
                         swa_full=not a.no_swa_full, n_rs_seq=a.rs_seq)
    own = derive(inv, a.plan, params)
    for n in notes:
        print(f"mtplib inventory: note: {n}", file=sys.stderr)
    if a.json:
        print(json.dumps({**own.to_json(), **({"notes": notes} if notes else {})}))
    else:
        print(render(own))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "inventory", help="tensor ownership, shard plan, caches and seam bytes of a model",
        description="Read the GGUF headers of a DeepSeek-V4 trunk (and its mtp- sidecar, or "
        "one file holding both) without reading weights, and derive every tensor's role, "
        "the graphs that read it and its shard for a plan of contiguous layer ranges; per "
        "shard the bytes, the replicas it needs and the caches it allocates for a context; "
        "and the seam bytes per token.")
    p.add_argument("model", help="trunk GGUF (or a single file holding trunk and MTP)")
    p.add_argument("--mtp", help="the trunk's mtp- sidecar GGUF")
    p.add_argument("--plan", help="shard plan as contiguous layer ranges, e.g. 0-20,21-42 "
                   "(default: one shard)")
    p.add_argument("--ctx", type=int, default=None,
                   help=f"context size for the cache bytes (llama n_ctx; default: "
                   f"min({DEFAULT_CTX}, the model's context_length); a value above it is "
                   "sized as asked, with a note)")
    p.add_argument("--seqs", type=int, default=1, help="sequences (n_seq_max)")
    p.add_argument("--ubatch", type=int, default=512, help="n_ubatch")
    p.add_argument("--rs-seq", type=int, default=0, help="n_rs_seq rollback depth")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32", "bf16", "q8_0"],
                   help="KV cache type (type_k) for the cache bytes")
    p.add_argument("--no-swa-full", action="store_true",
                   help="size SWA caches to the window + ubatch (llama_context_params."
                   "swa_full=false) instead of the C API's default full size")
    add_json_arg(p, "the derivation (with \"notes\" when there are any)")
    p.set_defaults(fn=run)
