#!/usr/bin/env bash
# The issue's target cell through the WAN lane (python -m mtplib.lab.wan): the trained pair,
# 100 ms RTT, every shard remote, head and drafter in the client, 16 held-out prompts x 64
# new tokens (the WAN evidence's target cell), 1 rep; warm on 2 and 3 shards (k 0 and 2) and
# cold (one `mtplib generate` process per generation, default options) on 3 shards (k=2);
# the baseline (patches/0001 alone) and the patched build (the full patch set), interleaved
# by build. Writes target/<build>/<mode>/ here; then `mtplib.reports.upstream_patches.report --write`.
#
#   evidence/upstream-patches/measure_target.sh BASELINE_UPSTREAM
#
# BASELINE_UPSTREAM: an .upstream folder whose patched/ holds the build of patches/0001
# alone, e.g. made in a scratch checkout:
#   git worktree add --detach /tmp/base HEAD && cd /tmp/base && git rm -q patches/000[2-9]* \
#     && ./dev.sh patched     # -> /tmp/base/.upstream (the wheel is cached by its patch hash)
# The baseline runs from a temporary worktree of HEAD whose .upstream points there, so this
# checkout's own .upstream is never touched.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE_UP="$(cd "${1:?usage: $0 BASELINE_UPSTREAM (an .upstream folder holding the 0001-only build)}" && pwd)"
[ -f "$BASE_UP/patched/llama_cpp/MTPLIB_PATCHES" ] || { echo "$BASE_UP/patched holds no patched build" >&2; exit 2; }
[ -f "$ROOT/.upstream/patched/llama_cpp/MTPLIB_PATCHES" ] || { echo "no patched build here: ./dev.sh setup" >&2; exit 2; }
OUT="$ROOT/evidence/upstream-patches/target"
TREE="$(mktemp -d)/baseline"
git -C "$ROOT" worktree add -q --detach "$TREE" HEAD
trap 'git -C "$ROOT" worktree remove --force "$TREE"' EXIT
ln -s "$ROOT/.venv" "$TREE/.venv"
ln -s "$BASE_UP" "$TREE/.upstream"
W='{"modes": ["warm"], "rtts_ms": [100], "ks": [0, 2], "plans": ["0-1,2-3", "0-0,1-2,3-3"], "topologies": ["remote"], "placements": ["client"], "head": "auto", "n_prompts": 16, "prompt_len": 64, "n_new": 64, "reps": 1, "warmup": 1, "fit_rtts_ms": [100]}'
C='{"modes": ["cold"], "cold_rtts_ms": [100], "cold_ks": [2], "rtts_ms": [100], "ks": [2], "plans": ["0-0,1-2,3-3"], "topologies": ["remote"], "placements": ["client"], "n_prompts": 16, "prompt_len": 64, "n_new": 64, "reps": 1, "fit_rtts_ms": [100]}'
run() {  # build mode config
  local tree="$ROOT"; [ "$1" = baseline ] && tree="$TREE"
  (cd "$tree" && MTPLIB_UPSTREAM=patched PYTHONPATH="$tree" "$ROOT/.venv/bin/python" -m mtplib.lab.wan \
     --config "$3" --out "$OUT/$1/$2")
}
run patched warm "$W"
run baseline warm "$W"
run patched cold "$C"
run baseline cold "$C"
(cd "$ROOT" && .venv/bin/python -m mtplib.reports.upstream_patches.report)
