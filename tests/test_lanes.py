"""Lane files are validated against a schema before anything runs (issue 15, item 2), and a
lane whose notebook fails says which one, where its partial output is, and records it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplib.cli import main
from mtplib.records import lanes as L
from mtplib.records.lanes import LaneError, LaneFailed, load_lane, run_lane

HEAD = "lane: t\nfixture: {preset: tiny, seed: 0}\n"
SMOKE = "notebooks: [00_fixture_smoke.ipynb]\n"


def _lane(tmp_path, text: str):
    p = tmp_path / "lane.yaml"
    p.write_text(text)
    return p


# (yaml text, pattern the one-line error must match): the corpus of issue 15 and more
BAD = [
    (HEAD + "notebooks: [5]\n", r"notebooks\[0\]: expected a notebook name"),
    (HEAD + "notebooks: [{parameters: {n_tokens: 8}}]\n", r"notebooks\[0\]\.notebook: missing"),
    (HEAD + "notebooks: [{notebook: 00_fixture_smoke.ipynb, params: {}}]\n",
     r"notebooks\[0\]: unknown keys \['params'\]"),
    (HEAD + "notebooks: []\n", r"notebooks: expected a non-empty list"),
    (HEAD + "notebooks: 00_fixture_smoke.ipynb\n", r"notebooks: expected a non-empty list"),
    (HEAD + "notebooks: [../README.md]\n", r"notebooks\[0\]\.notebook: expected a \.ipynb file"),
    (HEAD + "notebooks: [../notebooks/00_fixture_smoke.ipynb]\n", r"directly inside notebooks/"),
    (HEAD + "notebooks: [/etc/passwd.ipynb]\n", r"directly inside notebooks/"),
    (HEAD + "notebooks: [nope.ipynb]\n", r"nope\.ipynb not found"),
    ("lane: t\nfixture: [tiny]\n" + SMOKE, r"fixture: expected a mapping"),
    ("lane: t\nfixture: {preset: huge}\n" + SMOKE, r"fixture\.preset: expected one of"),
    ("lane: t\nfixture: {preset: tiny, seed: x}\n" + SMOKE, r"fixture\.seed: expected an int"),
    ("lane: t\nfixture: {preset: tiny, sede: 1}\n" + SMOKE, r"fixture: unknown keys \['sede'\]"),
    ("lane: t\nmodels: {sidecar: mtp-a.gguf}\n" + SMOKE, r"models\.trunk: missing"),
    ("lane: t\nmodels: {trunk: 5, sidecar: a}\n" + SMOKE, r"models\.trunk: expected a file"),
    ("lane: t\nmodels: [a, b]\n" + SMOKE, r"models: expected a mapping"),
    ("lane: t\n" + SMOKE, r"exactly one of 'fixture'"),
    (HEAD + SMOKE + "parameters: [1, 2]\n", r"parameters: expected a mapping"),
    (HEAD + SMOKE + "bench: [1, 2]\n", r"bench: expected a mapping"),
    (HEAD + SMOKE + "wan: 3\n", r"wan: expected a mapping"),
    (HEAD + SMOKE + "threads: two\n", r"threads: expected an int >= 1"),
    (HEAD + SMOKE + "threads: 0\n", r"threads: expected an int >= 1"),
    (HEAD + SMOKE + "evidence: DGR-065\n", r"evidence: expected a list"),
    (HEAD + SMOKE + "lane: [x]\n", r"lane: expected a string"),
    (HEAD + SMOKE + "wat: 1\n", r"unknown keys \['wat'\]"),
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n    parameters: [1]\n",
     r"notebooks\[0\]\.parameters: expected a mapping"),
    # a parameter of the wrong type or out of range, by the rule the notebook checks it with
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n    parameters: {n_tokens: many}\n",
     r"notebooks\[0\]\.parameters\.n_tokens: expected an int 1\.\.1024, got 'many'"),
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n    parameters: {n_tokens: true}\n",
     r"parameters\.n_tokens: expected an int"),
    (HEAD + "notebooks:\n  - notebook: 01_tensor_ownership.ipynb\n    parameters: {plan: 3}\n",
     r"parameters\.plan: expected a shard plan"),
    (HEAD + "notebooks:\n  - notebook: 01_tensor_ownership.ipynb\n    parameters: {plan: 0-1}\n",
     r"parameters\.plan: expected a shard plan .*layers 2-3 belong to no shard"),
    (HEAD + "notebooks: [00_fixture_smoke.ipynb, 01_tensor_ownership.ipynb,"
     " {notebook: 03_correctness.ipynb, parameters: {ks: 3}}]\n",
     r"notebooks\[2\]\.parameters\.ks: expected a list of draft lengths 1\.\.8 \(ints\), got 3"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n    parameters: {ks: [1, 9]}\n",
     r"notebooks\[0\]\.parameters\.ks\[1\]: expected an int 1\.\.8, got 9"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n    parameters: {plans: 0-1,2-3}\n",
     r"notebooks\[0\]\.parameters\.plans: expected a list of plans"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n"
     "    parameters: {plans: ['0-1,2-3', '0-2,2-3']}\n",
     r"parameters\.plans\[1\]: expected a shard plan .*overlaps"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n    parameters: {progress: 1}\n",
     r"parameters\.progress: expected True or False, got 1"),
    (HEAD + "notebooks:\n  - notebook: 05_wan.ipynb\n    parameters: {builds: [stok]}\n",
     r"parameters\.builds\[0\]: expected one of stock, patched, got 'stok'"),
    (HEAD + "notebooks:\n  - notebook: 05_wan.ipynb\n"
     "    parameters: {overrides: {stock: {ks: 2}}}\n",
     r"parameters\.overrides\.stock\.ks: expected a list of draft lengths 0\.\.8"),
    (HEAD + "notebooks:\n  - notebook: 05_wan.ipynb\n    parameters: {target: {n_new: 0}}\n",
     r"parameters\.target\.n_new: expected an int 1\.\.1024, got 0"),
    # the bench: and wan: sections, key by key (they used to fail notebooks later)
    (HEAD + SMOKE + "bench: {plans: [whole, '0-1,2-4']}\n",
     r"bench\.plans\[1\]: expected 'whole' or a shard plan .*out of range: the trunk has "
     r"layers 0-3"),
    (HEAD + SMOKE + "bench: {plans: ['0-1,2-3']}\n",
     r"bench\.plans: expected 'whole' among the plans"),
    (HEAD + SMOKE + "bench: {ks: 3}\n", r"bench\.ks: expected a list of draft lengths 1\.\.8"),
    (HEAD + SMOKE + "bench: {n_new: 1}\n", r"bench\.n_new: expected an int 2\.\.1024, got 1"),
    (HEAD + SMOKE + "bench: {sweep: {rates: [0.5, 2]}}\n",
     r"bench\.sweep\.rates\[1\]: expected a number 0\.\.1, got 2"),
    (HEAD + SMOKE + "bench: {sampling: {seeds: x}}\n",
     r"bench\.sampling\.seeds: expected an int 1\.\.1000, got 'x'"),
    (HEAD + SMOKE + "bench: {prompts: [{len: 4}]}\n",
     r"bench\.prompts\[0\]: expected a prompt text or \{seed: N, len: L\}"),
    (HEAD + SMOKE + "bench: {backend: tpu}\n", r"bench\.backend: expected one of cpu, gpu"),
    (HEAD + SMOKE + "bench: {kz: [1]}\n", r"bench: unknown keys \['kz'\]"),
    (HEAD + SMOKE + "wan: {plans: ['0-1;2-3']}\n", r"wan\.plans\[0\]: expected a shard plan"),
    (HEAD + SMOKE + "wan: {plans: ['0-1,3-4']}\n", r"wan\.plans\[0\]: .*gap before range 1"),
    (HEAD + SMOKE + "wan: {topologies: [remote, local]}\n",
     r"wan\.topologies\[1\]: expected one of remote, tail_local, got 'local'"),
    (HEAD + SMOKE + "wan: {rtts_ms: 50}\n", r"wan\.rtts_ms: expected a list of RTTs"),
    (HEAD + SMOKE + "parameters: {prompt_tokens: 7}\n",
     r"parameters\.prompt_tokens: expected a list"),
    # unknown notebook parameters (a typo) are refused, naming the notebook and its parameters
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n    parameters: {n_token: 8}\n",
     r"notebooks\[0\]\.parameters\.n_token: 00_fixture_smoke\.ipynb declares no parameter "
     r"'n_token' \(declared: .*n_tokens"),
    (HEAD + SMOKE + "parameters: {n_token: 8}\n",
     r"parameters\.n_token: no notebook of the lane declares 'n_token'"),
    # issue 39 item 8: every number within its stated range (key, value and range named)
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n"
     "    parameters: {n_tokens: 100000000000}\n",
     r"notebooks\[0\]\.parameters\.n_tokens: expected an int 1\.\.1024, got 100000000000"),
    (HEAD + SMOKE + "bench: {reps: 1000000000}\n",
     r"bench\.reps: expected an int 1\.\.1000, got 1000000000"),
    (HEAD + SMOKE + "bench: {warmup: 5000}\n", r"bench\.warmup: expected an int 0\.\.1000"),
    (HEAD + SMOKE + "bench: {n_ctx: 100000}\n",
     r"bench\.n_ctx: expected an int 1\.\.4096 \(the model's context_length\), got 100000"),
    (HEAD + SMOKE + "bench: {n_ctx: 64, n_new: 60}\n",
     r"bench\.n_new: expected an int <= 52 \(n_ctx 64 minus the longest prompt's 12 "
     r"tokens\), got 60"),
    (HEAD + SMOKE + "bench: {n_ctx: 64, sampling: {n_new: 60}}\n",
     r"bench\.sampling\.n_new: expected an int <= 52"),
    (HEAD + SMOKE + "bench: {prompts: [{seed: 0, len: 5000}]}\n",
     r"bench\.prompts\[0\]\.len: expected an int 1\.\.1024, got 5000"),
    (HEAD + SMOKE + "bench: {prompts: [{seed: 4294967296}]}\n",
     r"bench\.prompts\[0\]\.seed: expected an int 0\.\.4294967295"),
    (HEAD + SMOKE + "bench: {prompts: [" + ", ".join(["{seed: 0}"] * 1001) + "]}\n",
     r"bench\.prompts: expected a list of prompts with at most 1000 items, got 1001 items"),
    (HEAD + SMOKE + "bench: {sweep: {reps: 1000000}}\n",
     r"bench\.sweep\.reps: expected an int 1\.\.1000, got 1000000"),
    (HEAD + SMOKE + "bench: {sweep: {synth_seed: -1}}\n",
     r"bench\.sweep\.synth_seed: expected an int 0\.\.4294967295, got -1"),
    (HEAD + SMOKE + "bench: {sampling: {temperature: 1000}}\n",
     r"bench\.sampling\.temperature: expected a number 0\.\.100, got 1000"),
    (HEAD + SMOKE + "bench: {sampling: {seeds: 100000}}\n",
     r"bench\.sampling\.seeds: expected an int 1\.\.1000"),
    (HEAD + SMOKE + "wan: {n_prompts: 100000}\n", r"wan\.n_prompts: expected an int 1\.\.1000"),
    (HEAD + SMOKE + "wan: {reps: 100000}\n", r"wan\.reps: expected an int 1\.\.1000"),
    (HEAD + SMOKE + "wan: {prompt_len: 100000}\n", r"wan\.prompt_len: expected an int 1\.\.1024"),
    (HEAD + SMOKE + "wan: {n_new: 100000}\n", r"wan\.n_new: expected an int 1\.\.1024"),
    (HEAD + SMOKE + "wan: {n_ctx: 10000000}\n", r"wan\.n_ctx: expected an int 1\.\.1048576"),
    (HEAD + SMOKE + "wan: {mbits: [1000000]}\n",
     r"wan\.mbits\[0\]: expected Mbit/s > 0 or null \(unlimited\), at most 100000, "
     r"got 1000000"),
    (HEAD + SMOKE + "wan: {cost_model_tolerance: 5}\n",
     r"wan\.cost_model_tolerance: expected a number 0\.\.1, got 5"),
    ("lane: t\nfixture: {preset: tiny, seed: 4294967296}\n" + SMOKE,
     r"fixture\.seed: expected an int 0\.\.4294967295, got 4294967296"),
    (HEAD + SMOKE + "requires: {hardware: x, gpus: 100000}\n",
     r"requires\.gpus: expected an int 0\.\.64, got 100000"),
    (HEAD + SMOKE + "requires: {hardware: x, gpu_memory_gb: 100000}\n",
     r"requires\.gpu_memory_gb: expected a number 0\.\.1024 \(GB\)"),
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n"
     "    parameters: {prompt_tokens: [1, 256]}\n",
     r"parameters\.prompt_tokens\[1\]: expected a token id 0\.\.255 \(the model's vocabulary\)"),
    (HEAD + "notebooks:\n  - notebook: 00_fixture_smoke.ipynb\n    parameters: {seed: -1}\n",
     r"parameters\.seed: expected an int 0\.\.4294967295, got -1"),
    (HEAD + "notebooks:\n  - notebook: 01_tensor_ownership.ipynb\n    parameters: {ctx: 8192}\n",
     r"parameters\.ctx: expected an int 1\.\.4096 \(the model's context_length\), got 8192"),
    (HEAD + "notebooks:\n  - notebook: 01_tensor_ownership.ipynb\n"
     "    parameters: {flash_ctx: 2000000}\n",
     r"parameters\.flash_ctx: expected an int 1\.\.1048576, got 2000000"),
    (HEAD + "notebooks:\n  - notebook: 02_state_contract.ipynb\n"
     "    parameters: {n_seq: 1000, flash_ctxs: [8192]}\n",
     r"parameters\.n_seq: expected an int 1\.\.256, got 1000"),
    (HEAD + "notebooks:\n  - notebook: 02_state_contract.ipynb\n"
     "    parameters: {flash_ctxs: [8192, 2000000]}\n",
     r"parameters\.flash_ctxs\[1\]: expected an int 1\.\.1048576"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n"
     "    parameters: {seeds: 100000, n_new: 5000}\n",
     r"parameters\.seeds: expected an int 1\.\.1000, got 100000"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n    parameters: {n_new: 5000}\n",
     r"parameters\.n_new: expected an int 2\.\.1024, got 5000"),
    (HEAD + "notebooks:\n  - notebook: 03_correctness.ipynb\n"
     "    parameters: {sampling_seeds: 1000000000}\n",
     r"parameters\.sampling_seeds: expected an int 1\.\.1000, got 1000000000"),
]


@pytest.mark.parametrize("text,pattern", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_lane_refused_in_one_line(tmp_path, monkeypatch, text, pattern):
    def boom(*a, **k):  # validation must never execute a notebook
        raise AssertionError("a notebook ran")

    import papermill as pm

    monkeypatch.setattr(pm, "execute_notebook", boom)
    p = _lane(tmp_path, text)
    with pytest.raises(LaneError, match=pattern) as ei:
        load_lane(p)
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg
    # through the CLI: one line, exit 2, and no run folder left behind
    out = tmp_path / "out"
    assert main(["run", "--params", str(p), "--out", str(out), "--no-progress"]) == 2
    assert not out.exists() or not any(out.iterdir())


def test_plans_are_bounded_by_the_models_they_run_on(tmp_path):
    """The tiny fixture has 4 trunk layers: a 6-layer plan is refused for its notebooks and
    bench, but not for 05 and wan:, which run on the committed trained pair."""
    six = "'0-2,3-5'"
    p = _lane(tmp_path, HEAD + "notebooks:\n  - notebook: 01_tensor_ownership.ipynb\n"
              f"    parameters: {{plan: {six}}}\n")
    with pytest.raises(LaneError, match=r"notebooks\[0\]\.parameters\.plan: .*out of range"):
        load_lane(p)
    p = _lane(tmp_path, HEAD + "notebooks:\n  - notebook: 05_wan.ipynb\n"
              f"    parameters: {{overrides: {{stock: {{plans: [{six}]}}}}}}\n"
              f"wan: {{plans: [{six}]}}\n")
    assert load_lane(p).wan == {"plans": ["0-2,3-5"]}


def test_good_lanes_still_load():
    for p in sorted((L.REPO / "params").glob("*.yaml")):
        lane = load_lane(p)
        assert lane.notebooks and isinstance(lane.threads, int)


def test_lane_parameters_declared_by_some_notebook_are_accepted(tmp_path):
    # `plan` goes to every notebook; 01 declares it, 00 does not: accepted (papermill
    # passes it on), with 01's type checked
    p = _lane(tmp_path, HEAD + "notebooks: [00_fixture_smoke.ipynb, 01_tensor_ownership.ipynb]\n"
              "parameters: {plan: '0-1,2-3'}\n")
    assert load_lane(p).parameters == {"plan": "0-1,2-3"}


def test_models_lane_refused_leaves_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLIB_MODEL_ROOT", str(tmp_path))
    p = _lane(tmp_path, "lane: t\nmodels: {trunk: a.gguf, sidecar: mtp-a.gguf}\n" + SMOKE)
    with pytest.raises(LaneError, match="lacks the real model"):
        run_lane(p, out_root=tmp_path / "out", run_id="r", progress=False)
    assert not (tmp_path / "out" / "r").exists()


def test_wan_section_checked_before_running(tmp_path):
    p = _lane(tmp_path, HEAD + SMOKE + "wan: {rtt: [1]}\n")
    with pytest.raises(LaneError, match="wan: unknown keys"):
        run_lane(p, out_root=tmp_path / "out", run_id="r", progress=False)
    assert not (tmp_path / "out" / "r").exists()


def test_wan_prompt_and_generation_fit_the_default_context(tmp_path):
    """Issue 39 item 8: without n_ctx, prompt_len + n_new (each within its range) must fit
    the context the runs get by default; refused before the run folder exists."""
    p = _lane(tmp_path, HEAD + SMOKE + "wan: {prompt_len: 1024, n_new: 1024}\n")
    with pytest.raises(LaneError, match=r"wan: prompt_len \+ n_new \(2048\) do not fit "
                       r"n_ctx 2048 \(the default\)"):
        run_lane(p, out_root=tmp_path / "out", run_id="r", progress=False)
    assert not (tmp_path / "out").exists()


def test_failed_notebook_is_named_and_recorded(tmp_path, monkeypatch, capsys):
    """A notebook that raises: one line naming it and its partial output, exit 2, and the
    run record says failed with the notebook (papermill stubbed: no kernel starts)."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    calls = []

    def fake_execute(src, dst, **kw):
        calls.append(src)
        if len(calls) == 2:  # the second notebook fails after writing its partial output
            open(dst, "w").write("{}")
            raise PapermillExecutionError(3, 1, "1 / 0", "ZeroDivisionError",
                                          "division by zero", [])
        open(dst, "w").write("{}")

    monkeypatch.setattr(pm, "execute_notebook", fake_execute)
    p = _lane(tmp_path, HEAD + "notebooks: [00_fixture_smoke.ipynb, 01_tensor_ownership.ipynb,"
              " 02_state_contract.ipynb]\n")
    out = tmp_path / "out"
    rc = main(["run", "--params", str(p), "--out", str(out), "--run-id", "r", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(calls) == 2
    run_dir = out / "r"
    assert len(err) == 1 and "notebook 01_tensor_ownership.ipynb failed" in err[0]
    assert "ZeroDivisionError: division by zero" in err[0]
    assert f"partial output in {run_dir / '01_tensor_ownership.ipynb'}" in err[0]
    rec = json.loads((run_dir / "run_record.json").read_text())
    assert rec["status"] == "failed" and rec["failed_notebook"] == "01_tensor_ownership.ipynb"
    assert rec["partial_output"] == str(run_dir / "01_tensor_ownership.ipynb")
    assert [e["status"] for e in rec["notebooks"]] == ["ok", "failed: PapermillExecutionError"]

    # the same through the library call: LaneFailed, an MtplibError
    with pytest.raises(LaneFailed, match="01_tensor_ownership"):
        calls.clear()
        run_lane(p, out_root=out, run_id="r2", progress=False)


def test_any_crash_inside_a_run_records_failed(tmp_path, monkeypatch):
    """Whatever stops a run after its folder exists, the record never says ok."""
    import papermill as pm

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pm, "execute_notebook", crash)
    p = _lane(tmp_path, HEAD + SMOKE)
    with pytest.raises(KeyboardInterrupt):
        run_lane(p, out_root=tmp_path / "out", run_id="r", progress=False)
    rec = json.loads((tmp_path / "out" / "r" / "run_record.json").read_text())
    assert rec["status"] == "failed"


def test_runner_values_go_only_where_declared(tmp_path, monkeypatch):
    """Models, threads, run folder and shared parameters reach a notebook only if it declares
    them: 05 reads the trained pair and gets no trunk (papermill would warn "unknown
    parameter"); 00 gets the generated models; 01 gets the shared `plan`, 00 does not."""
    import papermill as pm

    got = {}

    def fake_execute(src, dst, parameters=None, **kw):
        got[Path(src).name] = parameters
        open(dst, "w").write("{}")

    monkeypatch.setattr(pm, "execute_notebook", fake_execute)
    p = _lane(tmp_path, HEAD + "notebooks: [00_fixture_smoke.ipynb, 01_tensor_ownership.ipynb,"
              " 05_wan.ipynb]\nparameters: {plan: '0-1,2-3'}\n")
    run_lane(p, out_root=tmp_path / "out", run_id="r", progress=False)
    for name, params in got.items():
        assert set(params) <= set(pm.inspect_notebook(str(L.NOTEBOOKS / name))), name
    assert "trunk" in got["00_fixture_smoke.ipynb"] and "trunk" not in got["05_wan.ipynb"]
    assert got["01_tensor_ownership.ipynb"]["plan"] == "0-1,2-3"
    assert "plan" not in got["00_fixture_smoke.ipynb"]
    assert all("run_dir" in v for v in got.values())
