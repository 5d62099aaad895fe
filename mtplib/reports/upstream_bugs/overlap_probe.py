"""Where the wrong h_nextn rows come from: graph nodes that share h_nextn's memory.

    python -m mtplib.reports.upstream_bugs.overlap_probe TRUNK.gguf

For a configuration, records every node of the main graph through cb_eval (answering
"ask" with no, so nothing changes) with its data address and size, then lists the nodes
computed AFTER `h_nextn` whose bytes overlap h_nextn's. Such a node overwrites the rows
before llama_get_embeddings_nextn copies them out. Also prints the node count of the
graph upstream reserved at context creation (its log line) and of the decode graph.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np

from mtplib.reports import common
from mtplib.runtime import ggml_tensor as gt
from mtplib.runtime import lib
from mtplib.runtime.model import Context, ContextConfig, Model
from mtplib.runtime.rows import force_reserve

MODULE = "mtplib.reports.upstream_bugs.overlap_probe"
CONFIGS = [
    # (label, kv, flash_attn, n_ctx, n_ubatch, n_tokens, masked)
    ("F32 KV, FA off, n_ubatch 7, 7 tokens", "f32", "off", 512, 7, 7, False),
    ("F32 KV, FA off, n_ubatch 64, 7 tokens", "f32", "off", 512, 64, 7, False),
    ("F16 KV, FA auto, n_ctx 1024, 300 tokens", "f16", "auto", 1024, 512, 300, False),
    ("F16 KV, FA auto, n_ctx 2048, 300 tokens", "f16", "auto", 2048, 512, 300, False),
]


def probe(m: Model, kv, fa, n_ctx, ub, n, masked, fix=False):
    nodes = []

    def cb(t, ask):
        if ask:
            nb = gt.ggml().ggml_nbytes(ctypes.addressof(t))
            nodes.append((gt.name(t), gt.op_name(t), int(t.data or 0), int(nb),
                          bool(t.view_src)))
        return False

    lib.LOG_TAIL.clear()
    cfg = ContextConfig(n_ctx=n_ctx, n_ubatch=ub, kv_type=kv, flash_attn=fa, n_threads=1,
                        nextn_rows="masked" if masked else "all")
    with Context(m, cfg, cb_eval=gt.eval_callback(cb)) as ctx:
        reserved = re.findall(r"graph.*?nodes = ([\d /]+)", "".join(lib.LOG_TAIL))
        if fix:
            force_reserve(ctx)
        toks = [int(x) for x in np.random.default_rng(0).integers(0, m.n_vocab, n)]
        ctx.decode(toks, range(n), logits=True)
    # the last ubatch's graph: from the last h_nextn back to the node before it's first node
    i_h = max(i for i, x in enumerate(nodes) if x[0] == "h_nextn")
    n_graph = sum(1 for x in nodes if x[0] == "h_nextn")  # one graph per ubatch
    per_graph = len(nodes) // n_graph
    start = i_h - (i_h % per_graph)
    g = nodes[start:start + per_graph]
    h = g[i_h - start]
    a0, a1 = h[2], h[2] + h[3]
    after = [x for x in g[i_h - start + 1:] if x[2] < a1 and a0 < x[2] + x[3] and not x[4]]
    return reserved, per_graph, h, after


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("trunk", metavar="TRUNK.gguf")
    m = Model(ap.parse_args(argv).trunk)
    for label, *cfg in CONFIGS:
        for fix in (False, True):
            reserved, per_graph, h, after = probe(m, *cfg, fix=fix)
            print(f"{label}{' + re-reserve' if fix else ''}: reserved graph nodes "
                  f"{reserved}, decode graph nodes {per_graph}; h_nextn {h[3]} bytes; "
                  f"{len(after)} later nodes write into it"
                  + (": " + ", ".join(f"{x[0]} ({x[1]})" for x in after[:8]) if after else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
