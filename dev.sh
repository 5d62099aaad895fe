#!/usr/bin/env bash
# mtplib developer entry point. Every command first makes sure .venv is complete.
#
#   ./dev.sh run  [--params FILE]   run every notebook on a lane (default: params/cpu-fixture.yaml)
#   ./dev.sh test [PYTEST ARGS]     run the test suite
#   ./dev.sh lab [--user] [ARGS]    JupyterLab at the repo root with the `mtplib` kernel; prints the URL
#                                   (--user: also install the kernel for your own Jupyter)
#   ./dev.sh notebooks              sync notebooks/*.py <-> *.ipynb (jupytext) and strip outputs
#   ./dev.sh setup                  only create/refresh .venv (and the patched upstream)
#   ./dev.sh patched                only build/install the patched upstream (patches/*.patch)
#   ./dev.sh gpu-bundle             write .device/ (pruned patched sdist + wheels) for the
#                                   one-command GPU device run (evidence/DGR-066/DEVICE.md)
#
# The pinned llama-cpp-python is an sdist: it is compiled once (about 7 minutes on 2 cores)
# with the RPC backend into a wheel cache outside the repo, keyed on version, build flags,
# Python and CPU, so fresh clones on the same machine reuse it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PINS="$ROOT/mtplib/pins.py"
pin() { sed -n "s/^$1 = \"\(.*\)\"$/\1/p" "$PINS"; }
LLAMA_VERSION="$(pin LLAMA_CPP_PYTHON_VERSION)"
LLAMA_CMAKE_ARGS="$(pin CMAKE_ARGS)"
# mtplib's cache folder (mtplib/envs.py: cache_dir); MTPLIB_CACHE is its deprecated old name
CACHE_DIR="${MTPLIB_CACHE_DIR:-${MTPLIB_CACHE:-$HOME/.cache/mtplib}}"

log() { printf '[dev.sh] %s\n' "$*" >&2; }

find_python() {
  for c in "${PYTHON:-}" python3.11 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
      echo "$c"; return 0
    fi
  done
  log "error: Python >= 3.11 not found (set PYTHON=/path/to/python3.11)"; exit 1
}

llama_ok() {
  # The right build: pinned version, RPC backend library, MTP bindings importable.
  "$PY" - "$LLAMA_VERSION" <<'EOF' >/dev/null 2>&1
import os, sys
import llama_cpp, llama_cpp.llama_cpp_ext  # noqa: F401
assert llama_cpp.__version__ == sys.argv[1], llama_cpp.__version__
lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
assert os.path.exists(os.path.join(lib, "libggml-rpc.so")), "no RPC backend"
EOF
}

wheel_dir() {
  local pyver cpu
  pyver="$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
  # GGML_NATIVE builds for this CPU: key the cache on its flags.
  cpu="$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-8)"
  echo "${MTPLIB_WHEEL_CACHE:-$CACHE_DIR/wheels}/llama-cpp-python-$LLAMA_VERSION-rpc-$pyver-$cpu"
}

setup() {
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    "$(find_python)" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
  fi
  if ! llama_ok; then
    local wd; wd="$(wheel_dir)"
    if ! ls "$wd"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
      log "building llama-cpp-python==$LLAMA_VERSION from source with CMAKE_ARGS='$LLAMA_CMAKE_ARGS'"
      log "(about 7 minutes on 2 cores; cached in $wd)"
      mkdir -p "$wd"
      CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$PY" -m pip wheel -q --no-deps --no-cache-dir \
        --no-binary llama-cpp-python -w "$wd.tmp" "llama-cpp-python==$LLAMA_VERSION"
      mv "$wd.tmp"/*.whl "$wd"/ && rmdir "$wd.tmp"
    fi
    log "installing the cached llama-cpp-python build"
    "$PY" -m pip install -q "numpy>=1.26" "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
    "$PY" -m pip install -q --force-reinstall --no-deps "$wd"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
    llama_ok || { log "error: llama-cpp-python build lacks the RPC backend or MTP bindings"; exit 1; }
  fi
  local stamp="$VENV/.mtplib-deps" want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing mtplib and its dependencies into .venv"
    "$PY" -m pip install -q -e "$ROOT[dev]"
    "$PY" -m ipykernel install --sys-prefix --name mtplib --display-name "mtplib (.venv)" >/dev/null
    echo "$want" > "$stamp"
  fi
  # the kernel notebooks and lanes name: this venv's interpreter, whatever else is on the path
  if [ ! -f "$VENV/share/jupyter/kernels/mtplib/kernel.json" ]; then
    "$PY" -m ipykernel install --sys-prefix --name mtplib --display-name "mtplib (.venv)" >/dev/null
  fi
}

# The pinned sdist, kept once in the cache (`mtplib.lab.upstream_tools.sdist_candidates`):
# the patched build applies patches/ to it, and tests read upstream's own tables from it
# (common/arg.cpp's options, llama-chat.cpp's template names). A failed download only warns:
# those tests then skip and say so.
SDIST_DIR="$CACHE_DIR/sdist"
sdist() {
  local f="$SDIST_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz"
  [ -f "$f" ] && return 0
  mkdir -p "$SDIST_DIR"
  log "keeping the pinned sdist in $SDIST_DIR"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$SDIST_DIR.tmp" \
    "llama-cpp-python==$LLAMA_VERSION" && mv "$SDIST_DIR.tmp"/*.tar.gz "$f" \
    || log "warning: could not download the pinned sdist; tests that read it will skip"
  rm -rf "$SDIST_DIR.tmp"
}

# The patch set under patches/ (upstream fixes mtplib needs for shard-local V4 caches): the
# same pinned sdist with the patches applied to vendor/llama.cpp (checked, applied and
# reverse-checked against the exact pin first), built once into its own wheel cache (keyed on
# the patches' sha256 too) and installed beside the stock build into .upstream/patched;
# MTPLIB_UPSTREAM=patched selects it (mtplib/runtime/lib.py). MTPLIB_SKIP_PATCHED=1 skips it.
PATCHED="$ROOT/.upstream/patched"
patch_hash() { cat "$ROOT"/patches/*.patch 2>/dev/null | sha256sum | cut -c1-12; }

patched() {
  [ -n "$(ls "$ROOT"/patches/*.patch 2>/dev/null)" ] || return 0
  local want; want="$(patch_hash)"
  if [ "$(cat "$PATCHED/llama_cpp/MTPLIB_PATCHES" 2>/dev/null | head -1)" = "$want" ]; then
    return 0
  fi
  local wd; wd="$(wheel_dir)-patched-$want"
  if ! ls "$wd"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    local src; src="$(mktemp -d)"
    log "building the patched llama-cpp-python==$LLAMA_VERSION ($(ls "$ROOT"/patches/*.patch | wc -l) patches, about 7 minutes)"
    sdist
    if [ -f "$SDIST_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz" ]; then
      tar -xzf "$SDIST_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$src"
    else
      "$PY" -m pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$LLAMA_VERSION"
      tar -xzf "$src"/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$src"
    fi
    local tree="$src/llama_cpp_python-$LLAMA_VERSION"
    for p in "$ROOT"/patches/*.patch; do
      git -C "$tree/vendor/llama.cpp" apply --check "$p" || { log "error: $p does not apply to the pin"; exit 1; }
      git -C "$tree/vendor/llama.cpp" apply "$p"
      git -C "$tree/vendor/llama.cpp" apply --check --reverse "$p" || { log "error: $p does not reverse"; exit 1; }
    done
    mkdir -p "$wd"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$wd.tmp" "$tree"
    mv "$wd.tmp"/*.whl "$wd"/ && rmdir "$wd.tmp" && rm -rf "$src"
  fi
  rm -rf "$PATCHED"
  "$PY" -m pip install -q --no-deps --target "$PATCHED" "$wd"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
  { echo "$want"; (cd "$ROOT" && ls patches/*.patch); } > "$PATCHED/llama_cpp/MTPLIB_PATCHES"
}

cmd="${1:-help}"; shift || true
case "$cmd" in
  setup) setup; sdist; [ -n "${MTPLIB_SKIP_PATCHED:-}" ] || patched ;;
  patched) setup; patched ;;
  run)
    setup; [ -n "${MTPLIB_SKIP_PATCHED:-}" ] || patched
    if [ $# -eq 0 ]; then set -- --params "$ROOT/params/cpu-fixture.yaml"; fi
    exec "$VENV/bin/mtplib" run "$@" ;;
  test)
    setup; sdist; [ -n "${MTPLIB_SKIP_PATCHED:-}" ] || patched
    cd "$ROOT"
    exec "$PY" -m pytest "$@" ;;
  lab)
    setup
    cd "$ROOT"
    # a free port and our own token, so the URL printed here is the one that works; root
    # (this project's machines) needs --allow-root; no browser where there is no display
    port="${MTPLIB_LAB_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
    token="$("$PY" -c 'import secrets; print(secrets.token_hex(16))')"
    extra=()
    [ "$(id -u)" = 0 ] && extra+=(--allow-root)
    [ -z "${DISPLAY:-}" ] && extra+=(--no-browser)
    # --user (opt-in): the `mtplib` kernelspec also goes into the user's Jupyter data dir, so a
    # Jupyter outside this venv lists it (it refuses to replace another checkout's)
    args=()
    for a in "$@"; do
      if [ "$a" = "--user" ]; then
        kdir="$("$PY" -m mtplib.records.jupyter kernel --user)" || exit 2
        log "the mtplib kernel for your own Jupyter: $kdir"
      else
        args+=("$a")
      fi
    done
    log "JupyterLab at the repo root, kernel 'mtplib (.venv)': http://127.0.0.1:$port/lab?token=$token"
    # notebooks saved into notebooks/ (autosave too) are written without outputs, so the
    # committed pairs stay clean (mtplib.records.jupyter.strip_on_save)
    exec "$VENV/bin/jupyter" lab --ServerApp.root_dir="$ROOT" --ServerApp.ip=127.0.0.1 \
      --ServerApp.port="$port" --ServerApp.port_retries=0 --IdentityProvider.token="$token" \
      --MappingKernelManager.default_kernel_name=mtplib \
      --ContentsManager.pre_save_hook=mtplib.records.jupyter.strip_on_save \
      "${extra[@]}" "${args[@]}" ;;
  notebooks)
    setup
    cd "$ROOT"
    "$VENV/bin/jupytext" --sync notebooks/[0-9]*.py
    # committed notebooks carry no outputs nor run metadata (the form Lab's saves keep)
    "$PY" -m mtplib.records.jupyter strip notebooks/[0-9]*.ipynb ;;
  gpu-bundle)
    # standard library + git + pip only: no venv needed; the sdist comes from --sdist or
    # the project's copy, else pip downloads it (network)
    cd "$ROOT"
    args=("$@")
    if [ ! -f /work/upstream-src/llama_cpp_python-"$LLAMA_VERSION".tar.gz ] && \
       [[ " $* " != *" --sdist "* ]]; then
      src="$(mktemp -d)"
      "$(find_python)" -m pip download -q --no-deps --no-binary :all: -d "$src" \
        "llama-cpp-python==$LLAMA_VERSION"
      args+=(--sdist "$src/llama_cpp_python-$LLAMA_VERSION.tar.gz")
    fi
    exec "$(find_python)" -m mtplib.records.device_bundle "${args[@]}" ;;
  help|-h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) log "unknown command '$cmd'"; sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
