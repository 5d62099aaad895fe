"""`mtplib serve` with its batch scheduler's joins and steps logged to stderr (lines
``STEPLOG join n=<requests> lens=[...] <s>`` and ``STEPLOG step <slots> <s>``), for
`batch_bench.py --step-log`: whether requests sent together share one prefill, and what
each step of N slots cost in the service.

    PYTHONPATH=. .venv/bin/python evidence/serve/serve_steplog.py serve ARGS...
"""

from __future__ import annotations

import sys
import time

from mtplib.commands import serve_batch as sb

_join, _step = sb.BatchWorker._join, sb.BatchWorker._step


def join(self, sts) -> None:
    t = time.perf_counter()
    _join(self, sts)
    print(f"STEPLOG join n={len(sts)} lens={[len(s.tokens) for s in sts]} "
          f"{time.perf_counter() - t:.3f}", file=sys.stderr, flush=True)


def step(self) -> None:
    n, t = len(self.batch.active()), time.perf_counter()
    _step(self)
    print(f"STEPLOG step {n} {time.perf_counter() - t:.3f}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sb.BatchWorker._join, sb.BatchWorker._step = join, step
    from mtplib.cli import main

    raise SystemExit(main(sys.argv[1:]))
