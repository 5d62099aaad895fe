"""Does a configuration's outcome depend on the decode length? API vs captured rows for
decode lengths 1..64, 100, 128, 200, 256, 300, 400, 511, 512 on mtplib's default context
(n_ctx 2048, n_batch = n_ubatch = 512, F16 KV, flash attention auto), unmasked and masked,
as is and after force_reserve.

    python -m mtplib.reports.upstream_bugs.decode_lengths TRUNK.gguf

Prints one line per configuration (the finding evidence/upstream-bugs/README.md quotes).
"""

from __future__ import annotations

import numpy as np

from mtplib.reports import common
from mtplib.runtime.model import ContextConfig, Model
from mtplib.runtime.rows import CapturedRows, force_reserve

MODULE = "mtplib.reports.upstream_bugs.decode_lengths"
LENGTHS = list(range(1, 65)) + [100, 128, 200, 256, 300, 400, 511, 512]


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("trunk", metavar="TRUNK.gguf")
    m = Model(ap.parse_args(argv).trunk)
    for fix in (False, True):
        for masked in (False, True):
            cap = CapturedRows(m.n_embd_out)
            cfg = ContextConfig(nextn_rows="masked" if masked else "all", n_threads=1)
            bad, pos = [], 0
            with cap.open(m, cfg) as ctx:
                if fix:
                    force_reserve(ctx)
                for n in LENGTHS:
                    if pos + n > ctx.n_ctx:
                        ctx.clear()
                        pos = 0
                    flags = [i % 3 == 2 or i == n - 1 for i in range(n)] if masked else [True] * n
                    ctx.decode([p % m.n_vocab for p in range(pos, pos + n)], range(pos, pos + n),
                               logits=flags)
                    k = sum(flags) if masked else n
                    if np.abs(ctx.nextn_rows(k) - cap.take(k)).max() > 1e-5:
                        bad.append(n)
                    pos += n
            print(f"{'force_reserve' if fix else 'as is'}, {'masked' if masked else 'unmasked'}: "
                  f"{len(bad)} of {len(LENGTHS)} decode lengths with a wrong row"
                  + (f" (first: {bad[:5]})" if bad else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
