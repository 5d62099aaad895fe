"""The command line and the papermill pipeline, end to end on the fixture."""

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mtplib.records.lanes import LaneError, load_lane, run_lane

REPO = Path(__file__).resolve().parent.parent


def mtplib(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "mtplib.cli", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"mtplib {args} failed ({r.returncode}): {r.stderr}")
    return r


def test_fixture_cli_is_deterministic(tmp_path):
    a = json.loads(mtplib("fixture", "--out", tmp_path / "a", "--seed", 3).stdout)
    b = json.loads(mtplib("fixture", "--out", tmp_path / "b", "--seed", 3).stdout)
    assert a["trunk"]["sha256"] == b["trunk"]["sha256"]
    assert a["sidecar"]["sha256"] == b["sidecar"]["sha256"]
    assert a["config"]["compress_ratios"] == [0, 0, 4, 128, 0]


def test_generate_json_same_tokens_every_run(pair):
    outs = [json.loads(mtplib("generate", "--model", pair.trunk, "--tokens", "1,2,3",
                              "--n", 32, "--json").stdout) for _ in range(2)]
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 32
    assert {"ttft_s", "decode_tok_s"} <= set(outs[0]["metrics"])


def test_generate_swa_full_off_same_tokens_smaller_cache(pair):
    """--swa-full off (llama-server's setting): a window-sized SWA cache that evicts, the
    same greedy tokens as the full-size cache, with and without MTP."""
    base = ["generate", "--model", pair.trunk, "--tokens", "1,2,3", "--n", 300, "--ctx", 512,
            "--ubatch", 8, "--json"]
    on = json.loads(mtplib(*base, "--swa-full", "on").stdout)["tokens"]
    off = json.loads(mtplib(*base, "--swa-full", "off").stdout)["tokens"]
    mtp = json.loads(mtplib(*base, "--swa-full", "off", "--mtp", pair.sidecar,
                            "--draft", 2).stdout)["tokens"]
    assert on == off == mtp and len(on) == 300
    logs = {v: mtplib("generate", "--model", pair.trunk, "--tokens", "1,2", "--n", 2,
                      "--ctx", 512, "--ubatch", 8, "--swa-full", v, "--verbose").stderr
            for v in ("on", "off")}
    cells = {v: [int(n) for n in re.findall(r"creating\s+SWA KV cache, size = (\d+) cells",
                                             log)] for v, log in logs.items()}
    assert cells["on"] == [512] and len(cells["off"]) == 1 and cells["off"][0] < 512


def test_generate_prompt_text(pair):
    out = json.loads(mtplib("generate", "--model", pair.trunk, "--prompt", "hello",
                            "--n", 4, "--json").stdout)
    assert len(out["tokens"]) == 4


@pytest.mark.parametrize("args, msg", [
    (["--tokens", "1,2,999"], "token id 999 out of range"),
    (["--tokens", "1,2", "--prompt", "x"], "exactly one of --tokens"),
    (["--tokens", "1,2", "--n", "5000", "--ctx", "4096"], "exceed the context"),
])
def test_generate_bad_input_exits_2_with_message(pair, args, msg):
    r = mtplib("generate", "--model", pair.trunk, *args, check=False)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_generate_missing_model_exits_2(tmp_path):
    r = mtplib("generate", "--model", tmp_path / "none.gguf", "--tokens", "1", check=False)
    assert r.returncode == 2 and "not found" in r.stderr


def test_upstream_logs_silent_by_default(pair):
    r = mtplib("generate", "--model", pair.trunk, "--tokens", "1,2", "--n", 2, "--json")
    assert "llama_model_loader" not in r.stderr
    r = mtplib("generate", "--model", pair.trunk, "--tokens", "1,2", "--n", 2, "--verbose")
    assert "llama_model_loader" in r.stderr


def test_every_lane_file_parses():
    for p in sorted((REPO / "params").glob("*.yaml")):
        assert load_lane(p).notebooks


def test_bad_lane_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lane: x\nnotebooks: [nope.ipynb]\nfixture: {preset: tiny}\n")
    with pytest.raises(LaneError, match="nope.ipynb not found"):
        load_lane(bad)
    bad.write_text("lane: x\nnotebooks: [00_fixture_smoke.ipynb]\nfixture: {}\nwat: 1\n")
    with pytest.raises(LaneError, match="unknown keys"):
        load_lane(bad)
    with pytest.raises(LaneError, match="not found"):
        load_lane(tmp_path / "missing.yaml")


def test_real_model_lane_without_storage_stops_cleanly(tmp_path, monkeypatch):
    monkeypatch.delenv("MTPLIB_MODEL_ROOT", raising=False)
    lane = tmp_path / "real.yaml"
    lane.write_text("lane: real\nnotebooks: [00_fixture_smoke.ipynb]\n"
                    "models: {trunk: a.gguf, sidecar: mtp-a.gguf}\n")
    with pytest.raises(LaneError, match="MTPLIB_MODEL_ROOT"):
        run_lane(lane, out_root=tmp_path / "out", progress=False)
    monkeypatch.setenv("MTPLIB_MODEL_ROOT", str(tmp_path))
    with pytest.raises(LaneError, match="lacks the real model"):
        run_lane(lane, out_root=tmp_path / "out2", progress=False)


def test_pipeline_runs_default_lane_end_to_end(tmp_path):
    smoke = tmp_path / "smoke.yaml"
    smoke.write_text("lane: smoke\nfixture: {preset: tiny, seed: 0}\nthreads: 2\n"
                     "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n"
                     "    parameters: {n_tokens: 8}\n")
    run_dir = run_lane(smoke, out_root=tmp_path / "outputs", run_id="t1", progress=False)
    rec = json.loads((run_dir / "run_record.json").read_text())
    assert rec["status"] == "ok" and rec["pins"]["llama_cpp_python"] == "0.3.36"
    assert len(rec["model_sha256"]) == 2 and rec["cpu"]["logical_cores"] >= 1
    assert rec["started"] <= rec["ended"]
    nb = nbformat.read(str(run_dir / "00_fixture_smoke.ipynb"), as_version=4)
    assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    with pytest.raises(LaneError, match="already exists"):
        run_lane(smoke, out_root=tmp_path / "outputs", run_id="t1", progress=False)
