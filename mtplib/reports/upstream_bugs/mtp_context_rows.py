"""Control: the MTP context's own h_nextn rows (used for chained drafts) are right.

    python -m mtplib.reports.upstream_bugs.mtp_context_rows MTP-SIDECAR.gguf

graph_mtp sets res->t_h_nextn unconditionally, so h_nextn is already a graph output when
the scheduler reserves at context creation (unlike the main graph, where it exists only
once llama_set_embeddings_nextn was called). Compares API rows with captured rows for
kv f16/f32 x flash attention on/off x n_ubatch 7/64/512 x n_ctx 512/1024/2048, four decodes
each (20 tokens logits on the last, 1, 3, and 9 tokens with every other row output).
"""

from __future__ import annotations

import itertools

import numpy as np

from mtplib.reports import common
from mtplib.runtime.model import ContextConfig, Model
from mtplib.runtime.routing import require_mtp
from mtplib.runtime.rows import CapturedRows

MODULE = "mtplib.reports.upstream_bugs.mtp_context_rows"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("sidecar", metavar="MTP-SIDECAR.gguf")
    sidecar = ap.parse_args(argv).sidecar
    require_mtp(MODULE)  # an MTP context of its own: routed like every drafting path
    side = Model(sidecar, load_mtp=True)
    rng = np.random.default_rng(0)
    total = bad = 0
    for kv, fa, ub, n_ctx in itertools.product(["f16", "f32"], ["on", "off"], [7, 64, 512],
                                               [512, 1024, 2048]):
        cap = CapturedRows(side.n_embd_out)
        cfg = ContextConfig(n_ctx=n_ctx, n_ubatch=ub, kv_type=kv, flash_attn=fa, mtp=True,
                            nextn_rows="masked", n_threads=1)
        with cap.open(side, cfg) as c:
            pos = 0
            for n, pattern in ((20, "last"), (1, "all"), (3, "all"), (9, "every2")):
                flags = ([True] * n if pattern == "all" else [False] * (n - 1) + [True]
                         if pattern == "last" else [i % 2 == 0 or i == n - 1 for i in range(n)])
                rows = rng.standard_normal((n, side.n_embd_out)).astype(np.float32)
                c.decode(list(range(pos, pos + n)), range(pos, pos + n), logits=flags, rows=rows)
                k = sum(flags)
                total += 1
                bad += int(np.abs(c.nextn_rows(k) - cap.take(k)).max() > 1e-5)
                pos += n
    print(f"MTP-context decodes with a wrong nextn row: {bad} of {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
