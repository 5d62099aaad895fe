"""`mtplib fixture`: write a tiny DeepSeek-V4 trunk and its mtp- sidecar (and, with
--dspark, a DSpark draft of the trunk)."""

from __future__ import annotations

import argparse
import json

from mtplib.commands.common import add_json_arg


def run(a: argparse.Namespace) -> int:
    from mtplib.model.fixture import write_fixture

    pair = write_fixture(a.out, seed=a.seed, preset=a.preset, force=a.force)
    summary = pair.summary()
    if a.dspark:
        from mtplib.model.dspark.fixture import write_dspark_fixture
        from mtplib.stamps import sha256_file

        path = write_dspark_fixture(a.out, seed=a.seed, preset=a.preset, force=a.force)
        summary["dspark"] = {"path": str(path), "sha256": sha256_file(path),
                             "bytes": path.stat().st_size}
    print(json.dumps(summary, indent=None if a.json else 2))
    return 0


def register(sub) -> None:
    from mtplib.model.presets import PRESETS

    f = sub.add_parser("fixture", help="write a DeepSeek-V4 trunk GGUF and its mtp- sidecar",
                       description="Write a deterministic DeepSeek-V4 trunk GGUF and its MTP "
                       "sidecar mtp-<name>.gguf in upstream's layout; print a JSON summary "
                       "(paths, sha256, config). Same seed, same bytes.")
    f.add_argument("--out", required=True, help="output directory")
    f.add_argument("--seed", type=int, default=0, help="weights seed")
    f.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="configuration preset")
    f.add_argument("--dspark", action="store_true",
                   help="also write a random-weight DSpark draft of the trunk, "
                   "dspark-<trunk name>.gguf (arch dflash, 3 stages, block size 5; "
                   "`mtplib generate -m TRUNK -md DSPARK`)")
    f.add_argument("--force", action="store_true",
                   help="overwrite existing files with the same names but other contents")
    add_json_arg(f, "the summary on one line")
    f.set_defaults(fn=run)
