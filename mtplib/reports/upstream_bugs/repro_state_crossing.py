"""Repro for upstream bug 4: with n_rs_seq > 0 a shard's compressor state crosses shards.

Run with the stock build and with the patched one:
    python -m mtplib.reports.upstream_bugs.repro_state_crossing
    MTPLIB_UPSTREAM=patched python -m mtplib.reports.upstream_bugs.repro_state_crossing
Prints, per n_rs_seq, the cache tensors that crossed a shard connection while decoding.
"""

from __future__ import annotations

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.model.trained import trained_paths
from mtplib.reports import common
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.lib import upstream_info
from mtplib.runtime.settings import DecodeSettings

MODULE = "mtplib.reports.upstream_bugs.repro_state_crossing"


def main(argv: list[str] | None = None) -> int:
    common.parser(MODULE, __doc__).parse_args(argv)
    pair = trained_paths()
    prompt = list(range(100, 132))
    print("upstream build:", upstream_info()["build"])
    for rs in (0, 2):
        # the star: what the committed figures measured (the default seam then)
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", allow_cache_crossing=True,
                       seam="star") as r:
            opts = EngineOptions(k=0, n_rs_seq=rs, settings=DecodeSettings(n_ctx=256, n_threads=1))
            r.generate(prompt, 4, opts)  # warm-up: one-time allocations
            toks, m = r.generate(prompt, 8, opts)
            rep = r.rt.seam_report()
            print(f"n_rs_seq={rs}: cache bytes crossing {rep['cache_bytes_crossing']}, "
                  f"waits per decode {m.waits_per_step['decode']:.1f}, tensors "
                  f"{rep['cache_tensors_crossing']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
