"""`mtplib serve` with its batch scheduler's joins and steps logged to stderr (lines
``STEPLOG join n=<requests> lens=[...] <s>`` and ``STEPLOG step <slots> <s>``), for
`mtplib.reports.serve.batch_bench --step-log`: whether requests sent together share one
prefill, and what each step of N slots cost in the service.

    python -m mtplib.reports.serve.serve_steplog serve ARGS...

Every argument is the CLI's (`mtplib.cli`): this module only wraps the scheduler's two
methods before handing over. The STEPLOG lines are its product (batch_bench keeps them), so
they are written to stderr directly, not through logging.
"""

from __future__ import annotations

import sys
import time

from mtplib.serve.batch import BatchScheduler

JOIN, STEP = BatchScheduler.join, BatchScheduler.step


def join(self, sts) -> None:
    t = time.perf_counter()
    JOIN(self, sts)
    print(f"STEPLOG join n={len(sts)} lens={[len(s.tokens) for s in sts]} "
          f"{time.perf_counter() - t:.3f}", file=sys.stderr, flush=True)


def step(self) -> None:
    n, t = len(self.batch.active()), time.perf_counter()
    STEP(self)
    print(f"STEPLOG step {n} {time.perf_counter() - t:.3f}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """The CLI with the scheduler's joins and steps logged (every argument is the CLI's)."""
    BatchScheduler.join, BatchScheduler.step = join, step
    from mtplib.cli import main as cli_main

    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
