"""The carried bundle of a GPU device run (issue 24): the pinned llama-cpp-python sdist
pruned to what a CUDA + RPC build compiles, with `patches/` applied, plus wheels of the
pure-Python packages the H200 image lacks.

Why: the device machine is bare and has no network; `run` carries at most 64 MiB (the
working tree included, about 21 MB), and the pinned sdist alone is 76 MB. So the bundle
keeps the build system, llama.cpp's library sources, the CPU, CUDA and RPC backends, and
`tools/mtmd` (llama-cpp-python's CMakeLists builds it by default), and drops docs, tests,
example models, the web UI, converters and every other backend. It is written into an
ignored folder (`.device/`, default) that the device command names in `carry`; upstream's
source is never committed.

Usage: ``python -m mtplib.records.device_bundle [--sdist PATH] [--out .device]
[--no-wheels]``, or ``./dev.sh gpu-bundle``. Prints the manifest (sizes, sha256, patches).
Standard library only (plus ``git apply`` and ``pip download``), so it runs before set-up.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtplib import logs, pins
from mtplib.errors import InputError

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
#: What `run` carries in all, working tree included (the device tool's limit).
CARRY_LIMIT = 64 * 2**20
#: Where the pinned sdist is on this project's machines (reference: upstream-v4-mtp.md §1).
ROOT = f"llama_cpp_python-{pins.LLAMA_CPP_PYTHON_VERSION}"
DEFAULT_SDIST = Path("/work/upstream-src") / f"{ROOT}.tar.gz"
DEFAULT_OUT = REPO / ".device"
V = "vendor/llama.cpp/"

#: Paths (relative to the sdist root, fnmatch patterns) the build reads. Anything else
#: is dropped. Checked by building from the bundle (evidence/DGR-066/DEVICE.md).
KEEP = (
    "CMakeLists.txt", "pyproject.toml", "PKG-INFO", "README.md", "LICENSE.md",
    "llama_cpp/*",
    V + "CMakeLists.txt", V + "LICENSE", V + "cmake/*", V + "include/*",
    V + "src/*", V + "common/*", V + "vendor/*", V + "licenses/*",
    V + "tools/mtmd/*",
    V + "ggml/CMakeLists.txt", V + "ggml/cmake/*", V + "ggml/include/*",
    V + "ggml/src/*",
)
#: ggml backends the device build does not turn on (their directories are only entered
#: when their option is ON: ggml/src/CMakeLists.txt `ggml_add_backend`).
DROP_BACKENDS = ("cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino",
                 "sycl", "virtgpu", "vulkan", "webgpu", "zdnn", "zendnn", "blas")
DROP = tuple(f"{V}ggml/src/ggml-{b}/*" for b in DROP_BACKENDS) + (
    V + "tools/mtmd/test-*", V + "tools/mtmd/legacy-models/*", "*.gguf",
)
#: Files a CUDA + RPC build cannot do without: the bundle is refused without them.
REQUIRED = (
    "CMakeLists.txt", "pyproject.toml", "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py",
    V + "CMakeLists.txt", V + "src/models/deepseek4.cpp", V + "src/llama-kv-cache-dsv4.cpp",
    V + "ggml/src/ggml-cuda/CMakeLists.txt", V + "ggml/src/ggml-cuda/ggml-cuda.cu",
    V + "ggml/src/ggml-rpc/ggml-rpc.cpp", V + "ggml/src/ggml-cpu/CMakeLists.txt",
    V + "tools/mtmd/CMakeLists.txt",
)

#: Python packages the lane needs that the H200 image ('cuda', KINDS.md's package list)
#: does not hold: mtplib's and llama-cpp-python's dependencies and theirs, closed over
#: (non-Windows/macOS requirements), at the versions this project's venv runs; downloaded
#: for the image's Python (cp312, manylinux x86-64). The image has numpy, pandas,
#: matplotlib, pyyaml, tqdm, jinja2, typing-extensions, psutil, packaging, pygments,
#: requests, click, attrs, python-dateutil, six, markdown-it-py, mdurl.
DEVICE_WHEELS = (
    "asttokens==3.0.2", "comm==0.2.3", "debugpy==1.8.22", "diskcache==5.6.3",
    "entrypoints==0.4.2", "executing==2.3.0", "fastjsonschema==2.22.3", "gguf==0.19.0",
    "ipykernel==7.4.0", "ipython==9.18.1", "ipython-pygments-lexers==1.1.1", "jedi==0.20.1",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "jupyter-client==8.10.0",
    "jupyter-core==5.9.1", "jupytext==1.19.6", "matplotlib-inline==0.2.2",
    "mdit-py-plugins==0.7.0", "nbclient==0.11.0", "nbformat==5.11.1", "nest-asyncio2==1.7.4",
    "papermill==2.7.0", "parso==0.8.7", "pexpect==4.9.0", "platformdirs==4.14.9",
    "prompt-toolkit==3.0.53", "ptyprocess==0.7.0", "pure-eval==0.2.4", "pyzmq==27.3.0",
    "referencing==0.37.0", "rpds-py==2026.9.1", "stack-data==0.6.3", "tenacity==9.2.1",
    "tornado==6.6.1", "traitlets==5.16.1", "wcwidth==0.9.4",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass
class Manifest:
    """What the bundle holds, recorded beside it and in the device run's record."""

    sdist: str
    sdist_sha256: str
    tarball: str
    tarball_bytes: int
    unpacked_bytes: int
    files: int
    dropped_files: int
    patches: list[str]
    patch_set_sha256: str | None
    wheels: list[str] = field(default_factory=list)
    wheels_bytes: int = 0
    tree_bytes: int = 0
    carry_bytes: int = 0
    carry_limit: int = CARRY_LIMIT
    seconds: float = 0.0

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def keep(rel: str) -> bool:
    """True for a path (relative to the sdist root) the pruned bundle keeps."""
    if any(fnmatch.fnmatchcase(rel, p) for p in DROP):
        return False
    return any(fnmatch.fnmatchcase(rel, p) for p in KEEP)


def patch_set_sha256(patch_dir: Path) -> str | None:
    """The same hash dev.sh keys the patched build on (`cat patches/*.patch | sha256sum`)."""
    files = sorted(patch_dir.glob("*.patch"))
    if not files:
        return None
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:12]


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what `run` sends besides the carried paths: tracked files and untracked
    files git does not ignore."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
    total = 0
    for rel in out.split(b"\0"):
        p = repo / os.fsdecode(rel)
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def _apply_patches(tree: Path, patch_dir: Path) -> list[str]:
    """Apply patches/*.patch to vendor/llama.cpp as dev.sh does: check, apply, reverse-check."""
    applied = []
    for p in sorted(patch_dir.glob("*.patch")):
        cwd = tree / "vendor" / "llama.cpp"
        for args in (["--check"], [], ["--check", "--reverse"]):
            r = subprocess.run(["git", "apply", *args, str(p)], cwd=cwd, capture_output=True,
                               text=True)
            if r.returncode:
                raise InputError(f"patch {p.name} failed `git apply {' '.join(args)}` on the "
                                 f"pinned sdist: {r.stderr.strip()}")
        applied.append(p.name)
    return applied


def prune(sdist: Path, dest: Path) -> tuple[int, int]:
    """Unpack the kept members of ``sdist`` under ``dest/ROOT``; returns (kept, dropped)."""
    kept = dropped = 0
    with tarfile.open(sdist, "r:gz") as tf:
        members = []
        for m in tf.getmembers():
            name = m.name
            if not name.startswith(ROOT + "/") or not (m.isfile() or m.isdir()):
                dropped += m.isfile()
                continue
            rel = name[len(ROOT) + 1:]
            if m.isdir() or keep(rel):
                members.append(m)
                kept += m.isfile()
            else:
                dropped += 1
        tf.extractall(dest, members=members, filter="data")
    return kept, dropped


def missing_required(tree: Path) -> list[str]:
    return [r for r in REQUIRED if not (tree / r).is_file()]


def _remove_empty_dirs(tree: Path) -> None:
    for d, _, _ in sorted(os.walk(tree), key=lambda x: -len(x[0])):
        if d != str(tree) and not os.listdir(d):
            os.rmdir(d)


def _tar(tree: Path, out: Path) -> None:
    """A reproducible tar.gz of ``tree`` (sorted names, zeroed owners and times)."""
    import gzip

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in sorted(tree.rglob("*")):
            if not p.is_file():
                continue
            ti = tf.gettarinfo(str(p), arcname=f"{ROOT}/{p.relative_to(tree).as_posix()}")
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            with open(p, "rb") as f:
                tf.addfile(ti, f)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                               compresslevel=9) as gz:
        gz.write(buf.getvalue())


def download_wheels(dest: Path, specs: tuple[str, ...] = DEVICE_WHEELS,
                    python: str = sys.executable) -> list[str]:
    """`pip download` each spec for the image's Python (3.12, x86-64), no dependencies
    (every one the lane needs is listed), binary only."""
    dest.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest),
           *specs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise InputError(f"pip download of the device wheels failed: {r.stderr.strip()[-800:]}")
    return sorted(p.name for p in dest.glob("*.whl"))


def build_bundle(sdist: Path = DEFAULT_SDIST, out: Path = DEFAULT_OUT, *,
                 patch_dir: Path = REPO / "patches", wheels: bool = True,
                 repo: Path = REPO) -> Manifest:
    """Write ``out/<ROOT>.tar.gz`` (pruned, patched), ``out/wheels/`` and
    ``out/MANIFEST.json``; refuse a bundle that lacks a required file or that, with the
    working tree, would not fit the carry limit."""
    t0 = time.perf_counter()
    sdist = Path(sdist)
    if not sdist.is_file():
        raise InputError(f"no sdist at {sdist}: `pip download --no-deps --no-binary :all: "
                         f"llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}` and pass --sdist")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # outside any git work tree: `git apply` inside one would patch paths of that repo
    with tempfile.TemporaryDirectory() as tmp:
        kept, dropped = prune(sdist, Path(tmp))
        tree = Path(tmp) / ROOT
        miss = missing_required(tree)
        if miss:
            raise InputError(f"the pruned sdist lacks required files: {', '.join(miss)}")
        applied = _apply_patches(tree, patch_dir)
        _remove_empty_dirs(tree)
        unpacked = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
        tarball = out / f"{ROOT}.tar.gz"
        staged = out / (tarball.name + ".tmp")
        _tar(tree, staged)
        os.replace(staged, tarball)
    names: list[str] = []
    wheel_dir = out / "wheels"
    if wheels:
        if wheel_dir.exists():
            shutil.rmtree(wheel_dir)
        names = download_wheels(wheel_dir)
    wb = sum(p.stat().st_size for p in wheel_dir.glob("*.whl")) if wheel_dir.exists() else 0
    tb = tree_bytes(repo)
    m = Manifest(sdist=str(sdist), sdist_sha256=_sha256(sdist), tarball=tarball.name,
                 tarball_bytes=tarball.stat().st_size, unpacked_bytes=unpacked, files=kept,
                 dropped_files=dropped, patches=applied,
                 patch_set_sha256=patch_set_sha256(patch_dir), wheels=names,
                 wheels_bytes=wb, tree_bytes=tb)
    m.carry_bytes = m.tarball_bytes + m.wheels_bytes + m.tree_bytes
    m.seconds = round(time.perf_counter() - t0, 1)
    (out / "MANIFEST.json").write_text(json.dumps(m.to_dict(), indent=1) + "\n")
    if m.carry_bytes > CARRY_LIMIT:
        raise InputError(f"bundle + working tree = {m.carry_bytes / 2**20:.1f} MiB, over the "
                         f"{CARRY_LIMIT / 2**20:.0f} MiB carry limit")
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.records.device_bundle",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", type=Path, default=DEFAULT_SDIST)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-wheels", action="store_true", help="skip the pip download")
    a = ap.parse_args(argv)
    logs.configure()
    try:
        m = build_bundle(a.sdist, a.out, wheels=not a.no_wheels)
    except InputError as e:
        log.error("error: %s", e)
        return 2
    print(json.dumps(m.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
