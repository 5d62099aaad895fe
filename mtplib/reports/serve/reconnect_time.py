"""How long `RangedMTP.reconnect()` takes on the tiny fixture pair (local shards, plan
0-1,2-3, MTP k=2), on loopback and behind a 20 ms emulated WAN: 3 reconnects each after one
generation. Prints one line per WAN setting (seconds).

    python -m mtplib.reports.serve.reconnect_time
"""

from __future__ import annotations

import tempfile
import time

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.model.fixture import write_fixture
from mtplib.reports import common

MODULE = "mtplib.reports.serve.reconnect_time"


def main(argv: list[str] | None = None) -> int:
    common.parser(MODULE, __doc__).parse_args(argv)
    pair = write_fixture(tempfile.mkdtemp(prefix="mtplib-reconnect-"), seed=0)
    for wan in (None, "20"):
        t0 = time.monotonic()
        # the star: what the committed figures measured (the default seam then)
        with RangedMTP(str(pair.trunk), plan="0-1,2-3", sidecar=str(pair.sidecar),
                       wan=wan, seam="star") as r:
            opened = time.monotonic() - t0
            r.generate([5, 6, 7], 8)
            took = []
            for _ in range(3):
                t = time.monotonic()
                r.reconnect()
                took.append(round(time.monotonic() - t, 2))
        print(f"wan={wan or 'none'}: open {opened:.2f} s, reconnect {took} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
