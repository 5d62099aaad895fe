#!/usr/bin/env bash
# A/B of upstream's llama-bench builds: static (as llama-server), shared (as llama-cpp-python
# builds), shared with -fno-semantic-interposition. tg128 on v4-ratio-cpu, 7 rounds.
#   STATIC=~/.cache/mtplib/upstream-tools/<commit>/build/bin/llama-bench  (cmake --build build --target llama-bench)
#   SHARED=/tmp/ub-shared/bin/llama-bench   NSI=/tmp/ub-shared-nsi/bin/llama-bench
# Shared builds, from ~/.cache/mtplib/upstream-tools/<commit>/:
#   cmake -S src -B /tmp/ub-shared -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
#     -DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
#     -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
#   (the same into /tmp/ub-shared-nsi with -DCMAKE_C_FLAGS=-fno-semantic-interposition
#    -DCMAKE_CXX_FLAGS=-fno-semantic-interposition); cmake --build DIR --target llama-bench -j 2
# Usage: MODEL=FX/v4-v4-ratio-cpu-s0.gguf ab_static_shared.sh THREADS
# Prints: threads build-dir tok/s loadavg-1m
set -euo pipefail
T=$1
for i in 1 2 3 4 5 6 7; do
  for b in "$STATIC" "$SHARED" "$NSI"; do
    v=$("$b" -m "$MODEL" -p 0 -n 128 -t "$T" -r 2 -o json 2>/dev/null |
        python3 -c 'import json,sys;print(json.load(sys.stdin)[0]["avg_ts"])')
    echo "$T $(basename "$(dirname "$(dirname "$b")")") $v $(cut -d' ' -f1 /proc/loadavg)"
  done
done
