"""How long `RangedMTP.reconnect()` takes on the tiny fixture pair (local shards, plan
0-1,2-3, MTP k=2), on loopback and behind a 20 ms emulated WAN: 3 reconnects each after one
generation. Prints one line per WAN setting (seconds).

    PYTHONPATH=. .venv/bin/python evidence/serve/reconnect_time.py
"""

from __future__ import annotations

import tempfile
import time

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.model.fixture import write_fixture


def main() -> None:
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


if __name__ == "__main__":
    main()
