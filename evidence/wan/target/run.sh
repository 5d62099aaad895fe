#!/usr/bin/env bash
# The WAN target run of issue 29 item 5 on the default (patched) build, resumable: each
# part below measures into its own folder; a rerun keeps every finished cell there (its
# wan.partial.json / wan.json) and measures only what is missing. Parts in priority order.
#   evidence/wan/target/run.sh [PART[@TAG] ...]     (default: every part)
# PART@TAG measures PART's cells again into the folder PART-TAG (a rerun on another build or
# a quieter host; the first folder is kept as it is).
# CLI defaults and a cold `mtplib generate` process per generation; the target parts use
# external `mtplib shard serve` processes on this host (--endpoints), the sweep the CLI's
# own shards. The 1-minute load average is logged each minute to DIR/loadavg.log. Every part
# runs on the star ("seam":"star"), what its first folders measured (the default seam then,
# so a config without the field resumes as the star).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
HERE="$ROOT/evidence/wan/target"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
TARGET='"modes":["cold"],"cold_rtts_ms":[100],"cold_ks":[0,2],"cold_shards":"endpoints","placements":["client"],"n_prompts":16,"prompt_len":64,"n_new":64,"reps":2,"fit_rtts_ms":[100],"seam":"star"'
SWEEP='"modes":["cold"],"cold_rtts_ms":[25,50,200],"cold_ks":[0,2],"cold_shards":"local","placements":["client"],"plans":["0-1,2-3","0-0,1-2,3-3"],"topologies":["remote"],"mbits":[null],"n_prompts":4,"prompt_len":64,"n_new":64,"reps":1,"fit_rtts_ms":[25,50],"seam":"star"'
config() {
  case "$1" in
    3shard-20) echo "{$TARGET,\"plans\":[\"0-0,1-2,3-3\"],\"topologies\":[\"remote\"],\"mbits\":[20]}" ;;
    tail-2shard) echo "{$TARGET,\"plans\":[\"0-1,2-3\"],\"topologies\":[\"tail_local\"],\"mbits\":[null]}" ;;
    sweep) echo "{$SWEEP}" ;;
    3shard-100-unlimited) echo "{$TARGET,\"plans\":[\"0-0,1-2,3-3\"],\"topologies\":[\"remote\"],\"mbits\":[100,null]}" ;;
    tail-3shard) echo "{$TARGET,\"plans\":[\"0-0,1-2,3-3\"],\"topologies\":[\"tail_local\"],\"mbits\":[null]}" ;;
    *) echo "unknown part '$1' (parts: 3shard-20 tail-2shard sweep 3shard-100-unlimited tail-3shard)" >&2; exit 2 ;;
  esac
}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(3shard-20 tail-2shard sweep 3shard-100-unlimited tail-3shard)
for part in "${parts[@]}"; do
  name="${part%@*}"; tag=""; [ "$name" = "$part" ] || tag="-${part#*@}"
  cfg="$(config "$name")"
  out="$HERE/$name$tag"; mkdir -p "$out"
  ( while :; do echo "$(date -u +%FT%TZ) $(cut -d' ' -f1 /proc/loadavg)" >> "$out/loadavg.log"; sleep 60; done ) &
  logger=$!
  echo "[run.sh] $part: $cfg" >&2
  "$ROOT/.venv/bin/python" -m mtplib.lab.wan --out "$out" --progress --config "$cfg" || { kill $logger; exit 1; }
  kill $logger
done
