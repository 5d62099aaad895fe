"""Issue 24: the carried bundle of the one-command GPU device run (mtplib.records.device_bundle)
and the device script's syntax."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mtplib.errors import InputError

REPO = Path(__file__).resolve().parent.parent


def test_keep_rules():
    from mtplib.records import device_bundle as DB

    V = DB.V
    assert DB.keep(V + "ggml/src/ggml-cuda/fattn.cu")
    assert DB.keep(V + "ggml/src/ggml-rpc/ggml-rpc.cpp")
    assert DB.keep("llama_cpp/llama_cpp.py")
    for dropped in (V + "ggml/src/ggml-vulkan/ggml-vulkan.cpp", V + "models/x.gguf",
                    V + "docs/build.md", V + "tools/server/server.cpp", "docs/index.md",
                    V + "ggml/src/ggml-metal/ggml-metal.m", V + "tests/test-backend-ops.cpp"):
        assert not DB.keep(dropped), dropped


@pytest.mark.slow
def test_bundle_from_the_pinned_sdist_fits_and_is_complete(tmp_path):
    from mtplib.records import device_bundle as DB

    if not DB.DEFAULT_SDIST.is_file():
        pytest.skip(f"the pinned sdist is not at {DB.DEFAULT_SDIST} on this machine")
    m = DB.build_bundle(DB.DEFAULT_SDIST, tmp_path, wheels=False)
    assert m.carry_bytes < DB.CARRY_LIMIT and m.tarball_bytes < 16 * 2**20
    assert m.patches and m.patch_set_sha256 == DB.patch_set_sha256(REPO / "patches")
    with tarfile.open(tmp_path / m.tarball) as tf:
        names = {n[len(DB.ROOT) + 1:] for n in tf.getnames()}
        assert set(DB.REQUIRED) <= names
        assert not any("/ggml-vulkan/" in n or n.endswith(".gguf") for n in names)
        # the patch is in the bundle: its added lines are in the patched file
        patch = sorted((REPO / "patches").glob("*.patch"))[0].read_text()
        target = next(line[6:] for line in patch.splitlines() if line.startswith("+++ b/"))
        added = [line[1:] for line in patch.splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        text = tf.extractfile(f"{DB.ROOT}/{DB.V}{target}").read().decode()
        assert all(a in text for a in added[:5])
    saved = json.loads((tmp_path / "MANIFEST.json").read_text())
    assert saved["tarball_bytes"] == m.tarball_bytes and saved["carry_limit"] == 64 * 2**20


def test_bundle_refuses_a_missing_sdist(tmp_path):
    from mtplib.records import device_bundle as DB

    with pytest.raises(InputError, match="no sdist"):
        DB.build_bundle(tmp_path / "none.tar.gz", tmp_path / "out", wheels=False)


def test_device_script_parses_and_names_its_phases():
    script = REPO / "device" / "h200_run.sh"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    for phase in ("probe", "unpack", "wheels", "build", "install", "check", "lane", "slice",
                  "pack"):
        assert f"phase {phase} {phase}" in text, phase
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in text and "-DGGML_RPC=ON" in text
    assert "--no-build-isolation" in text  # the device has no network


def test_shard_device_choice(monkeypatch):
    """A shard serves the CPU unless --device/$MTPLIB_SHARD_DEVICE asks for the GPU; a GPU
    asked of a CPU-only build, or an unknown kind, is refused before upstream serves."""
    from mtplib.errors import MtplibError
    from mtplib.runtime import rpc
    from mtplib.runtime.devices import gpu_devices

    monkeypatch.delenv(rpc.SHARD_DEVICE_ENV, raising=False)
    assert rpc.shard_device() == rpc.cpu_device() == rpc.shard_device("cpu")
    monkeypatch.setenv(rpc.SHARD_DEVICE_ENV, "tpu")
    with pytest.raises(InputError, match="shard device must be one of cpu, gpu"):
        rpc.shard_device()
    if not gpu_devices():
        monkeypatch.setenv(rpc.SHARD_DEVICE_ENV, "gpu")
        with pytest.raises(MtplibError, match="no GPU device"):
            rpc.shard_device()
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", "shard", "serve", "--endpoint",
                        "127.0.0.1:1", "--device", "tpu"], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 2 and "invalid choice: 'tpu'" in r.stderr
