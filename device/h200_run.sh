#!/usr/bin/env bash
# One device command (issue 24): on a bare H200 machine with no network, build the pinned
# llama-cpp-python with CUDA (Hopper only, RPC on, patches applied) from the carried bundle,
# install mtplib's missing packages from carried wheels, run the GPU lane and the slice's
# layer cost, and write everything under $OUT (at most 8 files, 2 folders deep).
#
#   bash device/h200_run.sh            # on the device: carry [".device"] (./dev.sh gpu-bundle)
#   MTPLIB_DEVICE_REHEARSAL=1 OUT=/tmp/out PYTHON=.venv/bin/python bash device/h200_run.sh
#                                      # CPU rehearsal: CUDA off, the CPU lane
#                                      # (params/cpu-fixture.yaml), the same phases and record
# Knobs: MTPLIB_DEVICE_LANE (lane file), MTPLIB_DEVICE_SKIP (phases to leave out),
# MTPLIB_DEVICE_JOBS (build jobs, default nproc), MTPLIB_LAYER_STEPS (slice steps, 30).
#
# Phases (each timed into $OUT/device_record.json): probe, unpack, wheels, build, install,
# check, lane, slice, pack. A failing phase stops the script; the record and the log are
# written anyway (trap), so what ran comes back.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="${MTPLIB_DEVICE_BUNDLE:-$ROOT/.device}"
OUT="${OUT:?set OUT (the device tool sets it)}"
WORK="${MTPLIB_DEVICE_WORK:-/tmp/mtplib-device}"
REHEARSAL="${MTPLIB_DEVICE_REHEARSAL:-}"
JOBS="${MTPLIB_DEVICE_JOBS:-$(nproc)}"
VERSION="$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION = "\(.*\)"$/\1/p' "$ROOT/mtplib/pins.py")"
PY="${PYTHON:-python3}"
SITE="$WORK/site"
LOG="$OUT/device.log"
REC="$WORK/phases.tsv"
mkdir -p "$OUT" "$WORK"
: >"$REC"
exec > >(tee -a "$LOG") 2>&1

if [ -n "$REHEARSAL" ]; then
  CMAKE_ARGS="-DGGML_RPC=ON"
  LANE="$ROOT/params/cpu-fixture.yaml"
  SHARD_DEVICE=cpu
else
  # Hopper only (sm_90: HOPPER.md), the RPC backend, the CPU backend for this host
  CMAKE_ARGS="-DGGML_CUDA=ON -DGGML_RPC=ON -DCMAKE_CUDA_ARCHITECTURES=90"
  LANE="$ROOT/params/gpu-fixture.yaml"
  SHARD_DEVICE=gpu
fi
LANE="${MTPLIB_DEVICE_LANE:-$LANE}"
LAYER_STEPS="${MTPLIB_LAYER_STEPS:-30}"
# phases to leave out (space-separated names); the rehearsal leaves out the slice, which
# `mtplib layer-cost` measures on its own here (evidence/layer-cost/)
SKIP=" ${MTPLIB_DEVICE_SKIP-${REHEARSAL:+slice}} "

now() { date +%s.%N; }
child_cpu() {  # CPU seconds (user + sys) of the finished children of THIS shell, from
  # `times` run here (a $(...) subshell has no children of its own): sets CHILD_CPU
  times >"$WORK/.times"
  CHILD_CPU="$(tail -1 "$WORK/.times" | awk '{ for (i = 1; i <= 2; i++) {
    split($i, a, "m"); sub("s", "", a[2]); t += a[1] * 60 + a[2] } } END { printf "%.1f", t }')"
}
T0="$(now)"
phase() {  # phase NAME CMD...: run, time, record; stop the script on failure
  local name="$1"; shift
  if [[ "$SKIP" == *" $name "* ]]; then
    echo "=== phase $name: skipped"; printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 0 >>"$REC"
    return 0
  fi
  local t c
  t="$(now)"; child_cpu; c="$CHILD_CPU"
  echo "=== phase $name: start $(date -u +%H:%M:%S)"
  "$@"
  local rc=$?
  local dt cpu
  dt="$(awk -v a="$(now)" -v b="$t" 'BEGIN { printf "%.1f", a - b }')"
  child_cpu
  cpu="$(awk -v a="$CHILD_CPU" -v b="$c" 'BEGIN { printf "%.1f", a - b }')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$cpu" >>"$REC"
  echo "=== phase $name: rc=$rc, ${dt}s wall, ${cpu}s CPU (children)"
  if [ "$rc" -ne 0 ]; then exit "$rc"; fi
}

write_record() {  # always: the phases, the machine, the build flags
  local rc=$?
  "$PY" - "$REC" "$OUT/device_record.json" "$rc" "$CMAKE_ARGS" "$REHEARSAL" "$T0" <<'EOF' || true
import json, os, platform, subprocess, sys, time
rec, out, rc, cmake_args, rehearsal, t0 = sys.argv[1:]
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - a missing tool is a fact to record
        return f"unavailable: {e}"
phases = []
for line in open(rec):
    name, prc, secs, cpu = line.rstrip("\n").split("\t")
    phases.append({"phase": name, "rc": prc if prc == "skipped" else int(prc),
                   "seconds": round(float(secs), 1), "cpu_seconds": round(float(cpu), 1)})
d = {"schema": "mtplib.device_record/1", "exit": int(rc), "rehearsal": bool(rehearsal),
     "cmake_args": cmake_args, "phases": phases,
     "total_seconds": round(time.time() - float(t0), 1),
     "gpu": sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
               "--format=csv,noheader"),
     "nvcc": sh("nvcc", "--version").splitlines()[-1:] ,
     "cmake": sh("cmake", "--version").splitlines()[:1],
     "python": platform.python_version(), "cpus": os.cpu_count(),
     "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), platform.machine()),
     "kernel": platform.release()}
json.dump(d, open(out, "w"), indent=1)
print(json.dumps({k: d[k] for k in ("exit", "phases", "total_seconds", "gpu")}))
EOF
}
trap write_record EXIT

probe() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || \
    [ -n "$REHEARSAL" ]
  command -v nvcc && nvcc --version | tail -1
  cmake --version | head -1; ninja --version; "$PY" --version
  "$PY" -c "import numpy, scikit_build_core; print('numpy', numpy.__version__, \
'scikit-build-core', scikit_build_core.__version__)"
  test -f "$BUNDLE/llama_cpp_python-$VERSION.tar.gz" || {
    echo "no bundle in $BUNDLE: run ./dev.sh gpu-bundle and carry .device"; return 3; }
  if [ -z "$REHEARSAL" ]; then  # cuBLAS: the toolkit's, else the pip wheel's (hints)
    local inc
    inc="$(ls /usr/local/cuda/include/cublas_v2.h 2>/dev/null || find /usr/local /opt \
      /usr/include /usr/lib -name cublas_v2.h 2>/dev/null | head -1)"
    echo "cublas_v2.h: ${inc:-NOT FOUND}"
    [ -n "$inc" ] || return 4
    if [ "$inc" != /usr/local/cuda/include/cublas_v2.h ]; then
      local lib; lib="$(dirname "$(dirname "$inc")")/lib"
      mkdir -p "$WORK/cublas"
      for l in cublas cublasLt; do  # the wheel ships only the versioned .so
        ln -sf "$(ls "$lib"/lib$l.so* | head -1)" "$WORK/cublas/lib$l.so"
      done
      CMAKE_ARGS="$CMAKE_ARGS -DCUDA_cublas_LIBRARY=$WORK/cublas/libcublas.so \
-DCUDA_cublasLt_LIBRARY=$WORK/cublas/libcublasLt.so -DCMAKE_CUDA_FLAGS=-I$(dirname "$inc") \
-DCMAKE_CXX_FLAGS=-I$(dirname "$inc")"
    fi
  fi
  echo "CMAKE_ARGS=$CMAKE_ARGS"
}

unpack() {
  rm -rf "$WORK/src" && mkdir -p "$WORK/src" &&
    tar -xzf "$BUNDLE/llama_cpp_python-$VERSION.tar.gz" -C "$WORK/src"
}

wheels() {  # the packages the image lacks; none when rehearsing in the venv
  [ -n "$REHEARSAL" ] && return 0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$BUNDLE"/wheels/*.whl
}

build() {  # no network: no build isolation (the image has scikit-build-core, cmake, ninja)
  CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" "$PY" -m pip wheel -q \
    --no-deps --no-build-isolation --no-cache-dir -w "$WORK/wheel" \
    "$WORK/src/llama_cpp_python-$VERSION"
}

install() {  # beside the wheels; the marker makes mtplib report the patched build
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade \
    "$WORK"/wheel/llama_cpp_python-"$VERSION"-*.whl || return
  "$PY" - "$BUNDLE/MANIFEST.json" "$SITE/llama_cpp/MTPLIB_PATCHES" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
open(sys.argv[2], "w").write("\n".join([m["patch_set_sha256"]]
                                       + [f"patches/{p}" for p in m["patches"]]) + "\n")
EOF
}

check() {
  "$PY" -m mtplib.cli info --json >"$WORK/info.json" && cat "$WORK/info.json" || return
  [ -n "$REHEARSAL" ] || "$PY" - <<'EOF'
from mtplib.runtime.devices import backend_info
b = backend_info()
print(b)
assert b["gpu_devices"], "the CUDA build registered no GPU device"
EOF
  # the kernel papermill starts: this interpreter's, in a prefix of our own (the image's
  # stays untouched; JUPYTER_PATH, exported below, points there); the rehearsal's venv has one
  [ -n "$REHEARSAL" ] || "$PY" -m ipykernel install --prefix "$WORK/jupyter" --name mtplib \
    --display-name "mtplib (device)" >/dev/null
}

lane() {  # the lane; device memory sampled beside it
  local mem_pid=""
  if [ -z "$REHEARSAL" ]; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 500 \
      >"$WORK/gpu_memory.csv" 2>&1 &
    mem_pid=$!
  fi
  MTPLIB_SHARD_DEVICE="$SHARD_DEVICE" "$PY" -m mtplib.cli run --params "$LANE" \
    --out "$WORK/runs" --run-id device --no-progress
  local rc=$?
  [ -n "$mem_pid" ] && kill "$mem_pid" 2>/dev/null
  return $rc
}

slice() {  # issue 24 item 3: the V4-Flash-width slice's per-layer, verify and draft cost
  "$PY" -m mtplib.cli layer-cost --fixtures "$WORK/slice" --out "$OUT/layer-cost.json" \
    --steps "$LAYER_STEPS" --threads "$JOBS" --json
}

pack() {  # at most 8 files come back: the run folder (models left out) as one archive
  tar -czf "$OUT/run.tar.gz" -C "$WORK/runs" --exclude='*.gguf' device || return
  cp "$WORK/info.json" "$OUT/" 2>/dev/null
  cp "$WORK/gpu_memory.csv" "$OUT/" 2>/dev/null
  cp "$WORK/runs/device/run_record.json" "$OUT/" 2>/dev/null
  ls -la "$OUT"
}

export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -n "$REHEARSAL" ] || export JUPYTER_PATH="$WORK/jupyter/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
export MTPLIB_UPSTREAM=stock  # the build installed here is the patched one (its marker says)
phase probe probe
phase unpack unpack
phase wheels wheels
phase build build
phase install install
phase check check
phase lane lane
phase slice slice
phase pack pack
