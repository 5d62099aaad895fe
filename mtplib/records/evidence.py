"""Evidence READMEs generated from a run's raw metrics, and the check that they only say
what the metrics say.

- `write_evidence_readme(run_dir, story, out)`: the README of a story, every number
  formatted from the run's raw metrics (``run_record.json`` and the story's own files,
  `STORY_RAW`: ``bench/bench.json`` for DGR-066, ``dgr065_ownership.json`` and
  ``dgr065_state.json`` for DGR-065).
- `numbers_trace(text, raw)`: the numbers in a README that do not appear in the raw metrics
  (the rule is `TRACE_RULE`, also printed at the end of every README; DGR-065's README
  prints it as `TRACE_RULE_DGR065`, naming its own files).
- `copy_run(run_dir, story, dest)`: what ``mtplib evidence`` does: copy a run's executed
  notebooks, raw metrics, plots and run record into ``evidence/<story>/`` and write the
  README there (refusing to overwrite a different file unless forced); DGR-065 copies only
  its notebooks (01, 02), their metrics and the run record (`STORY_FILES`).

A run (``mtplib run``) writes its READMEs into ``outputs/<run-id>/evidence/<story>/``; it
never touches ``evidence/`` in the repo by itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from mtplib.errors import InputError, WouldOverwrite
from mtplib.stamps import sha256_file

BENCH_DIR = "bench"

#: The sections of bench.json a README may cite; its per-run rows (`runs`, `sweep_runs`)
#: are what the summaries are computed from (tests recompute them), not cited directly, so
#: that thousands of timings cannot make an arbitrary number "appear" by chance.
CITED_BENCH_KEYS = ("config", "reference_s9", "backend", "wall_s", "prompts", "summary",
                    "sweep", "break_even", "sampling")

TRACE_RULE = (
    "A number in this README traces to the raw metrics when formatting some numeric value "
    "of `run_record.json` or of the summary sections of `bench/bench.json` (config, "
    "reference_s9, backend, wall_s, prompts, summary, sweep, break_even, sampling; the "
    "per-run rows they are computed from are not cited) or a numeric key there, with the "
    "same number of decimals, gives the same text; a number written directly before `%` "
    "may also match the raw value times 100 (a fraction shown as a percentage). Not "
    "numbers, by rule: headings (lines starting with `#`), code spans in backticks "
    "(commands, paths, hashes, run ids, dates), link targets, and words that contain a "
    "letter or one of `§#@` (identifiers such as `k=1`, V4, DGR-066, pos-1).")


# -- tracing ----------------------------------------------------------------------------
_WORD = re.compile(r"[^\s|()\[\],;:*]+")
_NUM = re.compile(r"\d+(?:\.\d+)?(%?)")
_IDENT = re.compile(r"[A-Za-z§#@_]")


def readme_numbers(text: str) -> list[str]:
    """Numbers of a README as written (``"12.5"``, ``"77.0%"``), by the rule above."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        line = re.sub(r"`[^`]*`", " ", line)
        line = re.sub(r"\]\([^)]*\)", "] ", line)
        for word in _WORD.findall(line):
            if _IDENT.search(word):
                continue
            for m in _NUM.finditer(word):
                out.append(m.group(0))
    return out


def _raw_values(obj) -> Iterable[float]:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, int | float):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and re.fullmatch(r"\d+(?:\.\d+)?", k):
                yield float(k)
            yield from _raw_values(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _raw_values(v)


def _formats(values: Iterable[float], scale: float, max_decimals: int = 6) -> set[str]:
    out = set()
    for v in values:
        for d in range(max_decimals + 1):
            out.add(f"{abs(v) * scale:.{d}f}")
    return out


def cited(raw: dict) -> dict:
    """The part of the raw metrics a README may cite (`CITED_BENCH_KEYS`)."""
    out = dict(raw)
    if "bench" in out:
        out["bench"] = {k: v for k, v in out["bench"].items() if k in CITED_BENCH_KEYS}
    return out


def numbers_trace(readme_text: str, raw: dict) -> list[str]:
    """The numbers in ``readme_text`` that do not appear in ``raw`` (by `TRACE_RULE`);
    ``raw`` as `load_raw` returns it."""
    values = list(_raw_values(cited(raw)))
    plain, pct = _formats(values, 1.0), _formats(values, 100.0)
    missing = []
    for n in readme_numbers(readme_text):
        ok = (n[:-1] in pct or n[:-1] in plain) if n.endswith("%") else n in plain
        if not ok:
            missing.append(n)
    return missing


#: The raw metrics files a story's README may cite besides ``run_record.json`` (key in the
#: dict `load_raw` returns -> path in the run directory); read when present.
STORY_RAW: dict[str, dict[str, str]] = {
    "DGR-066": {"bench": f"{BENCH_DIR}/bench.json"},
    "DGR-065": {"ownership": "dgr065_ownership.json", "state": "dgr065_state.json"},
}


def load_raw(run_dir: str | Path, story: str = "DGR-066") -> dict:
    """The raw metrics the story's README may cite: the run record and the story's own
    metrics files (`STORY_RAW`; DGR-066: the bench metrics)."""
    run_dir = Path(run_dir)
    raw = {"run_record": json.loads((run_dir / "run_record.json").read_text())}
    for key, rel in STORY_RAW.get(story, {}).items():
        if (run_dir / rel).exists():
            raw[key] = json.loads((run_dir / rel).read_text())
    return raw


# -- formatting -------------------------------------------------------------------------
def _f(v, d: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{d}f}"


def _pct(v, d: int = 1) -> str:
    return "n/a" if v is None else f"{100 * v:.{d}f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _run_rows(rec: dict) -> list[list[str]]:
    """The rows every story's "The run" table starts with: how to repeat the run."""
    git, pins = rec.get("git", {}), rec.get("pins", {})
    return [
        ["command", f"`{rec.get('command')}`"],
        ["lane", f"`{rec.get('lane')}` (`{rec.get('params_file')}`)"],
        ["git commit", f"`{git.get('commit')}` (uncommitted changes: `{git.get('dirty')}`)"],
        ["pins", f"`llama-cpp-python=={pins.get('llama_cpp_python')}`, llama.cpp "
                 f"`{pins.get('llama_cpp_commit')}`, `{pins.get('cmake_args')}`"],
    ]


def _model_rows(rec: dict, label: str) -> list[list[str]]:
    sha = rec.get("model_sha256", {})
    return [[f"{label}: {key}", f"`{Path(path).name}` sha256 `{sha.get(path, '?')}`"]
            for key, path in rec.get("models", {}).items()]


class _Links:
    def __init__(self, run_dir: Path, out: Path) -> None:
        self.run_dir, self.base = run_dir, out.parent

    def __call__(self, rel: str, text: str | None = None) -> str:
        p = self.run_dir / rel
        href = os.path.relpath(p, self.base).replace(os.sep, "/")
        return f"[{text or rel}]({href})" if p.exists() else f"{text or rel} (missing)"


# -- DGR-066 ----------------------------------------------------------------------------
def _k_label(k: int) -> str:
    return "off" if k == 0 else f"k={k}"


def _dgr066(run_dir: Path, raw: dict, link: _Links) -> str:
    rec = raw["run_record"]
    if "bench" not in raw:
        raise InputError(f"{run_dir}: no {BENCH_DIR}/bench.json: the lane did not run the "
                         "benchmark (notebook 04_benchmark)")
    b = raw["bench"]
    cfg = b["config"]
    summ = [r for r in b["summary"] if r["plan"] == "whole"]
    off = next(r for r in summ if r["k"] == 0)
    on = [r for r in summ if r["k"] > 0]
    gpus = rec.get("gpu") or []
    backend = b.get("backend", {})
    notebooks = [n["notebook"] for n in rec.get("notebooks", [])]
    L: list[str] = []
    w = L.append

    w("# DGR-066 part 3: MTP off vs on benchmark and the evidence pipeline")
    w("")
    w("Generated by `mtplib.records.evidence` from the raw metrics of run "
      f"`{Path(rec['run_dir']).name}` "
      f"({link(BENCH_DIR + '/bench.json')}, {link('run_record.json')}). Do not edit: "
      "`mtplib evidence --run RUN_DIR --story DGR-066` rewrites it, and "
      "`tests/test_bench.py` checks that every number here appears in those files "
      "(rule at the end).")
    w("")
    w("## The run")
    w("")
    cpu = rec.get("cpu", {})
    rows = [
        *_run_rows(rec),
        ["CPU", f"`{cpu.get('model')}`, {cpu.get('logical_cores')} logical cores"],
        ["GPU and driver", ", ".join(f"`{g['name']}` driver `{g['driver']}`" for g in gpus)
         or "none"],
        ["llama.cpp backends", "`" + ", ".join(backend.get("backends", [])) + "`; devices `"
         + ", ".join(d["name"] for d in backend.get("devices", [])) + "`"],
        ["threads", f"lane {rec.get('threads')}, benchmark {cfg['threads']}"],
        ["benchmark wall time", f"{_f(b['wall_s'])} s"],
        ["network", f"`{rec.get('network')}`"],
        ["started", f"`{rec.get('started')}`"],
        ["executed notebooks", ", ".join(link(n) for n in notebooks) or "none"],
    ]
    rows += _model_rows(rec, "model")
    L += _table(["", ""], rows)
    w("")

    w("## Criterion 1: MTP off vs on, whole model")
    w("")
    n_prompts = len(b["prompts"])
    w(f"Each configuration: {n_prompts} prompts × {cfg['n_new']} new tokens, "
      f"{cfg['warmup']} warm-up run (excluded) then {cfg['reps']} measured repetitions per "
      f"prompt, {cfg['threads']} thread(s); greedy decoding. MTP off is the same loop "
      "without drafts. Notebook: " + link("04_benchmark.ipynb") + "; table: "
      + link(BENCH_DIR + "/bench_summary.csv") + "; every run: "
      + link(BENCH_DIR + "/bench_runs.csv") + ".")
    w("")
    L += _table(
        ["config", "runs", "decode tok/s median", "min", "max", "spread %",
         "speed-up vs off", "TTFT ms", "acceptance", "pos-1", "pos-2", "pos-3",
         "mean accepted per step"],
        [[_k_label(r["k"]), str(r["runs"]), _f(r["decode_tok_s_median"]),
          _f(r["decode_tok_s_min"]), _f(r["decode_tok_s_max"]),
          _f(r["decode_tok_s_spread_pct"]), _f(r["speedup"], 2), _f(r["ttft_ms_median"], 2),
          _pct(r["acceptance"]), _pct(r["acceptance_pos_1"]), _pct(r["acceptance_pos_2"]),
          _pct(r["acceptance_pos_3"]), _f(r["mean_accept_len"], 3)] for r in summ])
    w("")
    w("Acceptance-length histogram (verify steps by number of accepted drafts):")
    w("")
    kmax = max((r["k"] for r in on), default=0)
    L += _table(["config", *[f"{a} accepted" for a in range(kmax + 1)]],
                [[_k_label(r["k"]), *[str(r["accept_len_hist"].get(str(a), "")) if a <= r["k"]
                                      else "" for a in range(kmax + 1)]] for r in on])
    w("")
    w("Time split (ms per generated token, summed over the measured runs; share of the "
      "total in brackets):")
    w("")
    parts = ["prefill", "draft", "verify", "feed", "rollback"]
    L += _table(["config", *parts],
                [[_k_label(r["k"]), *[f"{_f(r[f'ms_per_token_{p}'], 3)} "
                                      f"({_f(r[f'share_{p}_pct'])}%)" for p in parts]]
                 for r in summ])
    w("")
    w("Quality against MTP off (greedy: same tokens, with the near-tie allowance of "
      "`mtplib.lab.quality`):")
    w("")
    qrows = []
    for r in on:
        s = (f"{r['sampling_equal_streams']} of {r['sampling_streams']} equal, TV distance "
             f"{_f(r['sampling_tv_distance'], 3)}") if "sampling_streams" in r else "not run"
        qrows.append([_k_label(r["k"]), f"{r['equal_to_off_runs']} of {r['runs']}",
                      _f(r["token_agreement_pct"]) + "%", str(r["near_tie_divergences"]),
                      str(r["unexplained_divergences"]), s])
    L += _table(["config", "greedy runs equal to off", "token agreement",
                 "near-tie divergences", "unexplained divergences",
                 "sampled streams (sample-and-match)"], qrows)
    samp = cfg.get("sampling")
    if samp:
        w("")
        w(f"Sampling check: temperature {samp['temperature']}, top-p {samp['top_p']}, "
          f"{samp['seeds']} seeds per prompt, {samp['n_new']} tokens; the TV distance "
          "compares the pooled token frequencies of MTP on and off.")
    w("")
    w("Memory (upstream's own sizes; peak RSS is the process peak so far, and the "
      "configurations run in the order of the table):")
    w("")
    L += _table(["config", "peak RSS MiB", "trunk weights MiB", "MTP weights MiB",
                 "target cache state KiB", "MTP cache state KiB", "seam bytes per token"],
                [[_k_label(r["k"]), _f(r["rss_peak_mib"], 2), _f(r["trunk_weights_mib"], 3),
                  _f(r["mtp_weights_mib"], 3), _f(r["target_seq_state_kib"], 2),
                  _f(r["mtp_seq_state_kib"], 2),
                  "n/a (whole model: no seam)" if r["seam_bytes_per_token"] is None
                  else _f(r["seam_bytes_per_token"])] for r in summ])
    w("")
    ranged = [r for r in b["summary"] if r["plan"] != "whole"]
    if ranged:
        w("Ranged (the trunk's layer ranges on loopback RPC shard processes, the MTP sidecar "
          "on the tail shard; seam bytes are all bytes on every shard connection while "
          "generating, per generated token, counted by relays in front of the shards; the "
          "per-step-kind figures and the contract's minimum are in 03_correctness):")
        w("")
        L += _table(["plan", "config", "runs", "decode tok/s median", "speed-up vs off",
                     "greedy runs equal to off", "acceptance", "seam bytes per token"],
                    [[r["plan"], _k_label(r["k"]), str(r["runs"]), _f(r["decode_tok_s_median"]),
                      _f(r["speedup"], 2), f"{r['equal_to_off_runs']} of {r['runs']}",
                      "n/a" if r["acceptance"] is None else _pct(r["acceptance"]),
                      _f(r["seam_bytes_per_token"])] for r in ranged])
        w("")
    w("Plots: " + ", ".join(link(f"{BENCH_DIR}/plots/{n}.png", n) for n in
                            ("speed_vs_k", "acceptance_per_position", "time_split",
                             "seam_bytes")) + ".")
    w("")

    w("## Criterion 2: acceptance sweep and break-even")
    w("")
    sc = cfg.get("sweep")
    if not sc or not b["sweep"]:
        w("Not run on this lane (`bench.sweep` is off).")
    else:
        cost = ("the real MTP block drafts and is fed every step (its cost is paid), then "
                "its drafts are replaced" if sc["draft_cost"] == "mtp" else
                "drafting costs nothing (no MTP block)")
        w(f"The drafter proposes the target's own MTP-off continuation up to a drawn length "
          f"and a wrong token there; the length is drawn with upstream's "
          f"`--spec-synth-rates` semantics, the rate being the unconditional probability "
          f"that a position is accepted, the same at every position (so a step accepts "
          f"nothing with probability 1 − rate and otherwise all k drafts); {cost}. "
          f"{sc['reps']} measured repetitions per prompt after {sc['warmup']} warm-up. "
          f"Speed-up = median decode tok/s ÷ median MTP-off decode tok/s "
          f"({_f(off['decode_tok_s_median'])}). Only speed counts here: the sweep's "
          "drafts come from the reference, so its quality columns are invalid by design. "
          "Table: " + link(BENCH_DIR + "/bench_sweep.csv") + "; plot: "
          + link(BENCH_DIR + "/plots/speedup_curve.png", "speedup_curve") + ".")
        w("")
        L += _table(["config", "set rate", "measured pos-1 acceptance", "overall acceptance",
                     "decode tok/s median", "speed-up vs off"],
                    [[_k_label(r["k"]), _f(r["rate"], 2), _pct(r["acceptance_pos_1"]),
                      _pct(r["acceptance"]), _f(r["decode_tok_s_median"]),
                      _f(r["speedup"], 2)] for r in b["sweep"]])
        w("")
        w("Break-even (position-1 acceptance where the speed-up crosses 1):")
        w("")
        L += _table(["config", "break-even acceptance", "speed-up at lowest acceptance",
                     "speed-up at highest acceptance", "note"],
                    [[_k_label(r["k"]), _pct(r["break_even_acceptance"]),
                      _f(r["speedup_at_min_acceptance"], 2),
                      _f(r["speedup_at_max_acceptance"], 2), r["note"]]
                     for r in b["break_even"]])
    w("")
    ref = b["reference_s9"]
    d3, lp, vl = ref["deepseek_v3"], ref["llama_cpp_pr"], ref["vllm_v4"]
    w("Reference numbers (upstream-v4-mtp.md §9, marked on the plots; not measured here): "
      f"DeepSeek-V3 second-token acceptance {_pct(d3['second_token_acceptance_low'], 0)}–"
      f"{_pct(d3['second_token_acceptance_high'], 0)} with {_f(d3['speedup'])}× TPS; "
      f"llama.cpp V4 MTP PR about {_f(lp['speedup'])}× with draft length "
      f"{lp['k']} ({_f(lp['baseline_tok_s'])} tok/s baseline); vLLM V4 MTP per-position "
      f"acceptance {_pct(vl['acceptance_per_position'][0], 0)} / "
      f"{_pct(vl['acceptance_per_position'][1], 0)} with {vl['k']} drafts.")
    w("")

    w("## Criterion 3: lanes")
    w("")
    kind = "a generated fixture" if rec.get("fixture") else "model files"
    w(f"This run: lane `{rec.get('lane')}` ({kind}), "
      "plans `" + ", ".join(cfg["plans"]) + "`. The opt-in lanes `params/gpu-fixture.yaml` "
      "(needs a GPU build) and `params/v4-flash-h200.yaml` (needs a GPU build and the real "
      "V4-Flash trunk and sidecar under `MTPLIB_MODEL_ROOT`, never under /home) were not "
      "run here; on a machine without them they stop with a message before any notebook "
      "runs (`tests/test_bench.py`).")
    w("")
    w("## Criterion 4: evidence")
    w("")
    w("Raw metrics: " + ", ".join(link(f"{BENCH_DIR}/{n}") for n in (
        "bench.json", "bench_summary.csv", "bench_runs.csv", "bench_sweep.csv",
        "bench_sweep_runs.csv", "bench_break_even.csv", "bench_sampling.csv"))
      + "; run record: " + link("run_record.json") + " (command line, git commit, pins, "
      "sha256 of every GGUF, CPU/GPU and driver, threads, network, timestamps); the "
      "benchmark's backend and devices are in `bench.json` under `backend`.")
    w("")
    w("## Criterion 5: tests")
    w("")
    w("`tests/test_bench.py` runs the benchmark on a short CPU lane, regenerates this kind "
      "of README from the recorded metrics and checks that `numbers_trace` finds no "
      "number outside them (and that an injected number is caught); if this README is "
      "committed, the test regenerates it from the files beside it and compares.")
    w("")

    w("## Limitations")
    w("")
    pos1 = [r["acceptance_pos_1"] for r in on if r["acceptance_pos_1"] is not None]
    if rec.get("fixture"):
        w("- The models are random-weight fixtures: their MTP acceptance (position 1 here: "
          + ", ".join(_pct(a) for a in pos1) + ") says nothing about the real model; and "
          f"with a trunk of {_f(off['trunk_weights_mib'], 3)} MiB of weights, its decode "
          "costs do not scale like a real model's, so its speed-ups do not transfer either.")
    not_reached = [r for r in b["break_even"] if r["break_even_acceptance"] is None
                   and r["note"].startswith("not reached")]
    if not_reached:
        w("- On this lane MTP on is slower than MTP off even at the highest measured "
          "acceptance for " + ", ".join(_k_label(r["k"]) for r in not_reached)
          + " (speed-up at the highest acceptance: "
          + ", ".join(_f(r["speedup_at_max_acceptance"], 2) for r in not_reached)
          + "): one verify step (a batch of k+1 tokens plus k MTP drafts) costs more here "
          "than k+1 plain one-token steps, so there is no break-even to read on this lane.")
    spread = max((r["decode_tok_s_spread_pct"] or 0) for r in summ)
    w(f"- Timings come from a shared machine ({cpu.get('logical_cores')} logical cores); "
      f"the min-max spread of decode tok/s over repetitions reaches {_f(spread)}% of the "
      "median.")
    w("- Peak RSS is the process's peak so far (`ru_maxrss`): it grows along the table "
      "and is not the footprint of one configuration; upstream's weight and cache-state "
      "sizes are per configuration.")
    if all(p == "whole" for p in cfg["plans"]):
        w("- Ranged plans (layer ranges on RPC shards) are not wired into the benchmark "
          "yet (`mtplib.lab.bench._run_ranged`); seam bytes per token are therefore not "
          "measured: the whole model has no seam.")
    w("- The GPU and real-model lanes were not run in this run.")
    w("")
    w("## How numbers are traced")
    w("")
    w(TRACE_RULE)
    w("")
    return "\n".join(L)


# -- DGR-065 ----------------------------------------------------------------------------
DGR065_NOTEBOOKS = ("01_tensor_ownership.ipynb", "02_state_contract.ipynb")
DGR065_RAW = ("dgr065_ownership.json", "dgr065_state.json")

TRACE_RULE_DGR065 = (
    "A number in this README traces to the raw metrics when formatting some numeric value "
    "of `run_record.json`, `dgr065_ownership.json` or `dgr065_state.json` (or a numeric key "
    "there) with the same number of decimals gives the same text. Byte counts are written "
    "without thousands separators so that each one is a single number. Not numbers, by "
    "rule: "
    "headings (lines starting with `#`), code spans in backticks (commands, paths, hashes, "
    "plans, dates), link targets, and words that contain a letter or one of `§#@` "
    "(identifiers such as V4-Flash, DGR-066, `k=1`).")


def _yes(v: bool) -> str:
    return "yes" if v else "**no**"


def _names(xs) -> str:
    return ", ".join(f"`{x}`" for x in xs) if xs else "none"


def _dgr065(run_dir: Path, raw: dict, link: _Links) -> str:
    rec = raw["run_record"]
    missing = [n for n, k in zip(DGR065_RAW, ("ownership", "state"), strict=True)
               if k not in raw]
    if missing:
        raise InputError(f"{run_dir}: no {', '.join(missing)}: the lane did not run notebooks "
                         "01_tensor_ownership and 02_state_contract")
    own, st = raw["ownership"], raw["state"]
    if "fixture_reads" not in own or "fixture_checks" not in st:
        raise InputError(f"{run_dir}: {DGR065_RAW} were written by older notebooks (no "
                         "fixture_reads / fixture_checks); rerun notebooks 01 and 02")
    fx = own["fixture"]
    notebooks = {n["notebook"]: n for n in rec.get("notebooks", [])}
    n_shards = sorted(int(n) for n in own["flash_shards"])
    n_max = n_shards[-1]
    shard_words = "/".join(str(n) for n in n_shards)
    L: list[str] = []
    w = L.append

    w("# DGR-065: MTP ownership and the distributed state contract")
    w("")
    w("Generated by `mtplib.records.evidence` from the raw metrics of run "
      f"`{Path(rec['run_dir']).name}` "
      f"({link('dgr065_ownership.json')}, {link('dgr065_state.json')}, "
      f"{link('run_record.json')}). Do not edit: `mtplib evidence --run RUN_DIR --story "
      "DGR-065` rewrites it, and `tests/test_evidence_dgr065.py` checks that every number "
      "here appears in those files (rule at the end).")
    w("")

    # -- the run
    w("## The run")
    w("")
    cpu = rec.get("cpu", {})
    nb_cells = []
    for name in DGR065_NOTEBOOKS:
        e = notebooks.get(name)
        nb_cells.append(f"{link(name)} ({'not run' if e is None else e.get('status')}, "
                        f"`{e and e.get('started')}` to `{e and e.get('ended')}`)")
    rows = [
        *_run_rows(rec),
        ["CPU", f"`{cpu.get('model')}`, {cpu.get('logical_cores')} logical cores, "
                f"{cpu.get('mem_total_bytes')} bytes of memory"],
        ["GPU", ", ".join(f"`{g['name']}`" for g in rec.get("gpu") or []) or "none"],
        ["Python", f"`{rec.get('python')}` on `{rec.get('platform')}`"],
        ["network", f"`{rec.get('network')}`"],
        ["notebooks of this story", "; ".join(nb_cells)],
    ]
    rows += _model_rows(rec, "fixture model")
    L += _table(["", ""], rows)
    w("")
    w("Artifacts of this story in the run (sha256 of the files as they are beside this "
      "README's run):")
    w("")
    arts = []
    for name in (*DGR065_NOTEBOOKS, *DGR065_RAW):
        p = run_dir / name
        arts.append([link(name), f"`{sha256_file(p)}`" if p.exists() else "missing"])
    L += _table(["file", "sha256"], arts)
    w("")
    w("`run_record.json` is not hashed here: the pipeline completes it (end time, status, "
      "the READMEs written) after this README. The weight-less V4-Flash files are not kept "
      "as evidence (they are rebuilt deterministically by `mtplib fixture --preset "
      "v4-flash`); their header hashes are in criterion 3 below.")
    w("")

    # -- criterion 1: reads
    w("## Criterion 1: derived read_by equals the upstream graphs' reads (fixture)")
    w("")
    w(f"Fixture: the tiny random-weight DeepSeek-V4 pair of this run ({fx['n_layer']} trunk "
      f"layers + {fx['n_mtp']} MTP block, layout `{fx['layout']}`), plan `{fx['plan']}`, "
      f"n_ctx {fx['ctx']}. `mtplib.runtime.graph_reads.check_pair` runs one main decode on "
      "the trunk and one MTP decode on the sidecar; the context's eval callback records "
      "every weight tensor any graph node reads (through views too), and the set is compared "
      "with the tensors whose derived `read_by` names that graph. The same is done for one "
      "file holding trunk and MTP (upstream's single-file layout, loaded with `load_mtp`). "
      f"Notebook: {link(DGR065_NOTEBOOKS[0])}.")
    w("")
    rrows = []
    for layout, reads in own["fixture_reads"].items():
        for r in reads:
            rrows.append([layout, r["graph"], f"`{r['file']}`", str(r["derived"]),
                          str(r["observed"]), _names(r["missing_in_upstream"]),
                          _names(r["unexpected_in_upstream"]), _yes(r["equal"])])
    L += _table(["layout", "graph", "file", "tensors derived as read", "tensors upstream read",
                 "missing in upstream", "unexpected in upstream", "equal"], rrows)
    w("")
    eq = own["fixture_reads_equal"]
    w("Result: read_by equals the graphs' reads for "
      + ("both layouts." if all(eq.values()) else
         "**not** every layout: " + ", ".join(f"{k} {_yes(v)}" for k, v in eq.items()) + "."))
    w("")
    w("Tensors by file, role and reading graph (pair layout):")
    w("")
    L += _table(["file", "role", "read by", "tensors", "bytes"],
                [[r["file"], r["role"], r["read_by"], str(r["tensors"]), str(r["bytes"])]
                 for r in fx["roles"]])
    w("")
    w("Shipped but read by no graph: "
      + (", ".join(f"`{u['file']}:{u['name']}` ({u['bytes']} bytes)" for u in fx["unread"])
         or "none") + ".")
    w("")
    w(f"Replicas and duplicates on the fixture's tail shard under plan `{fx['plan']}`:")
    w("")
    L += _table(["shard", "kind", "tensor", "bytes", "read by", "provided by / duplicate of"],
                [[str(r["shard"]), r["kind"], f"`{r['file']}:{r['name']}`", str(r["bytes"]),
                  "+".join(r["read_by"]) or "none",
                  r.get("provided_by") or f"`{r.get('duplicate_of')}`"]
                 for r in fx["replicas"]])
    w("")

    # -- criterion 2: caches
    w("## Criterion 2: derived cache bytes equal upstream's allocation (fixture)")
    w("")
    w("For each context below, the same two decodes record every cache tensor the graphs "
      "touch (name, shape, type, bytes) and the size of each cache buffer upstream allocates "
      "(`ggml_backend_buffer_get_size`); the derived tensors must equal the touched ones and "
      "each derived buffer size must equal upstream's. Notebook: "
      + link(DGR065_NOTEBOOKS[1]) + ".")
    w("")
    for c in st["fixture_checks"]:
        p = c["params"]
        w(f"**Context:** n_ctx {p['n_ctx']}, {p['n_seq']} sequence(s), n_ubatch "
          f"{p['n_ubatch']}, K type `{p['type_k']}`, swa_full `{p['swa_full']}`, n_rs_seq "
          f"{p['n_rs_seq']}; cache tensors equal (main, MTP): "
          + ", ".join(_yes(t) for t in c["tensors_equal"])
          + f"; every buffer equal: {_yes(c['caches_equal'])}.")
        w("")
        L += _table(["context", "cache buffer", "tensors read", "derived bytes",
                     "upstream bytes", "equal"],
                    [[b["context"], f"`{b['cache']}`", str(b["tensors read"]),
                      str(b["derived bytes"]), str(b["upstream bytes"]), _yes(b["equal"])]
                     for b in c["buffers"]])
        w("")
    allc = all(c["caches_equal"] and all(c["tensors_equal"]) for c in st["fixture_checks"])
    w("Result: derived cache bytes " + ("equal" if allc else "do **not** all equal")
      + " upstream's allocation, tensor by tensor and buffer by buffer, for every context "
      "above. The MTP context's buffer includes a V cache its graph never reads "
      "(`mtp_swa_v_unread` in the tables below): the derivation counts it because upstream "
      "allocates it.")
    w("")

    # -- criterion 3: V4-Flash
    w("## Criterion 3: DeepSeek-V4-Flash at real scale")
    w("")
    w("`mtplib fixture --preset v4-flash` writes the trunk and sidecar tensor tables of the "
      "published V4-Flash config with the dtypes of upstream's converter mapping; the data "
      "region is a sparse hole (weight-less), so only headers are read.")
    w("")
    ff = own["flash_files"]
    L += _table(["file", "logical bytes", "bytes on disk", "header sha256"],
                [[f"`{ff[k]['file']}`", str(ff[k]["bytes"]), str(ff[k]["disk_bytes"]),
                  f"`{ff[k]['sha256_header']}`"] for k in ("trunk", "sidecar")])
    w("")
    w("Upstream's own loader accepts the tables: each file loaded with `no_alloc` "
      "(metadata only, nothing read or allocated, in a child process); its model size is "
      "compared with the derived bytes:")
    w("")
    L += _table(["file", "`load_mtp`", "upstream model size", "derived bytes",
                 "upstream parameters", "equal"],
                [[f"`{t['file']}`", f"`{t.get('load_mtp')}`", str(t.get("model_size")),
                  str(t["derived_bytes"]), str(t.get("n_params")), _yes(t["equal"])]
                 for t in own["table_check"]])
    w("")
    lim = own["derivation_limit_seconds"]
    w(f"**Derivation time** (reading both headers plus every derivation, "
      f"`ownership_report.flash_ownerships`): {_f(own['derivation_seconds'], 3)} s for "
      f"{own['derivations']} derivations in {link(DGR065_NOTEBOOKS[0])}, "
      f"{_f(st['derivation_seconds'], 3)} s for {st['derivations']} derivations "
      f"({shard_words} shards × every context × swa_full on and off) in "
      f"{link(DGR065_NOTEBOOKS[1])}; both notebooks assert under {lim} s, and "
      + ("both times are under it." if max(own["derivation_seconds"],
                                           st["derivation_seconds"]) < lim
         else "**a time is over it**."))
    w("")
    w(f"**Bytes held per shard** (even layer splits, n_ctx {own['flash_ctx']} for the cache "
      "column; the last shard holds the tail and the MTP sidecar):")
    w("")
    srows = []
    for n in n_shards:
        for s in own["flash_shards"][str(n)]:
            srows.append([str(n), f"`{s['plan']}`", str(s["shard"]), f"`{s['layers']}`",
                          str(s["bytes"]), _f(s["GiB"], 3), str(s["mtp"]),
                          str(s["replica_bytes"]), str(s["duplicate_bytes"]),
                          str(s["cache_bytes"])])
    L += _table(["shards", "plan", "shard", "layers", "bytes", "GiB", "MTP sidecar bytes",
                 "replica bytes", "duplicate bytes", "cache bytes"], srows)
    w("")
    w("Largest shard, even plan against a byte-balanced plan (`ownership.balanced_plan`):")
    w("")
    L += _table(["shards", "plan", "ranges", "largest shard GiB"],
                [[str(r["shards"]), r["plan"], f"`{r['ranges']}`",
                  _f(r["largest shard GiB"], 3)] for r in own["flash_plans"]])
    w("")
    mtp_file = next((t for t in own["table_check"] if t["file"] == "mtp"), None)
    n_layer = next((t.get("n_layer") for t in own["table_check"] if t["file"] == "trunk"), None)
    w(f"**MTP block bytes** (`blk.{n_layer}.*`, the sidecar's own block): "
      f"{own['mtp_block_bytes']}"
      + (f"; the whole sidecar is {mtp_file['derived_bytes']} bytes (with its embedding, "
         "head and norms)." if mtp_file else "."))
    w("")
    reps = own["flash_replicas"]
    same = all([{k: v for k, v in r.items() if k != "shard"} for r in reps[str(n)]]
               == [{k: v for k, v in r.items() if k != "shard"} for r in reps[str(n_max)]]
               for n in n_shards)
    w(f"**Replicas and duplicates** ({n_max} shards; "
      + ("the same tensors, on the tail shard, for every shard count above" if same
         else "they differ by shard count: see `flash_replicas` in the raw metrics") + "):")
    w("")
    L += _table(["shard", "kind", "tensor", "bytes", "read by", "provided by / duplicate of"],
                [[str(r["shard"]), r["kind"], f"`{r['file']}:{r['name']}`", str(r["bytes"]),
                  "+".join(r["read_by"]) or "none",
                  r.get("provided_by") or f"`{r.get('duplicate_of')}`"]
                 for r in reps[str(n_max)]])
    w("")
    ckeys = ["raw_swa_k", "csa_compressed_k", "hca_compressed_k", "indexer_k",
             "compressor_state", "mtp_swa_k", "mtp_swa_v_unread", "raw_swa_k_unread", "total"]
    tot = [r for r in st["flash_totals"] if r["shards"] == n_max]

    def _key(r):
        return (r["n_ctx"], r["swa_full"])

    by_n = {n: sorted((_key(r), [r[k] for k in ckeys]) for r in st["flash_totals"]
                      if r["shards"] == n) for n in n_shards}
    same_tot = all(v == by_n[n_max] for v in by_n.values())
    w("**Cache bytes, whole model** (every cache kind summed over the shards of the "
      f"{n_max}-shard plan; "
      + (f"the sums are identical for {shard_words} shards" if same_tot else
         "the sums differ by shard count: see `flash_totals` in the raw metrics")
      + "). These are the derivation's formulas at real scale, not an allocation (see "
      "Limitations):")
    w("")
    L += _table(["n_ctx", "swa_full", *[f"`{k}`" for k in ckeys]],
                [[str(r["n_ctx"]), f"`{r['swa_full']}`", *[str(r[k]) for k in ckeys]]
                 for r in tot])
    w("")
    w(f"Cache bytes per shard, {n_max} shards (column: n_ctx, swa_full):")
    w("")
    ctxs = sorted({r["n_ctx"] for r in tot})
    cols = [(c, f) for c in ctxs for f in (True, False)
            if f"{n_max}x{c}x{'full' if f else 'window'}" in st["flash"]]
    per = {col: st["flash"][f"{n_max}x{col[0]}x{'full' if col[1] else 'window'}"]
           for col in cols}
    L += _table(["shard", "layers", *[f"{c} `{'full' if f else 'window'}`" for c, f in cols]],
                [[str(s["shard"]), f"`{s['layers']}`",
                  *[str(per[col][i]["total"]) for col in cols]]
                 for i, s in enumerate(per[cols[0]])] if cols else [])
    w("")
    seam = st["seam_bytes_per_token"]
    dts = list(seam["per_seam"])
    vals = list(seam["per_seam"][dts[0]])
    w(f"**Seam bytes per token** (`mtplib.contract.seam_bytes_per_token`, per seam; a plan "
      f"of {n_max} shards has {seam['n_seams']} seams):")
    w("")
    L += _table(["value", *[f"{d} rows" for d in dts]],
                [[f"`{v}`", *[str(seam["per_seam"][d][v]) for d in dts]] for v in vals])
    w("")
    w("MTP runs on the tail shard, so no MTP hidden row crosses a seam: "
      "`mtp_hidden_remote` is what it would cost otherwise.")
    w("")

    # -- criterion 4: contract
    g, pol = st["golden"], st["policies"]
    w("## Criterion 4: contract golden fixtures and the alpha policy")
    w("")
    w(f"{link(DGR065_NOTEBOOKS[1])} writes the contract's golden fixtures afresh "
      f"(`mtplib.contract.golden.check_golden`, what `python -m mtplib.contract.golden "
      f"--check {g['dir']}` runs) and compares them byte for byte with the committed ones "
      f"in `{g['dir']}`: "
      + ("every fixture regenerated byte-identically." if g["identical"] else
         "**differing**: " + _names(g["differs"]) + "."))
    w("")
    L += _table(["fixture", "sha256 (committed)"],
                [[f"`{k}`", f"`{v}`"] for k, v in g["files"].items()])
    w("")
    w("Every named shard line-up of the fixtures (`golden.advert_sets`) negotiated for every "
      "recipe, plus unknown ones:")
    w("")
    L += _table(["policy", "`allow_mtp`", "decisions", "routed to MTP"],
                [[f"`{k}`", f"`{v['allow_mtp']}`", str(v["decisions"]), str(v["routed_mtp"])]
                 for k, v in pol.items()])
    w("")
    alpha = pol.get("alpha", {})
    w(("The alpha policy routed no decision to MTP" if alpha.get("routed_mtp") == 0 else
       "**The alpha policy routed MTP**")
      + "; the beta column shows the same line-ups do route MTP when a policy allows it. "
      "The property test `tests/test_contract_capabilities.py::"
      "test_alpha_never_routes_property` (hypothesis: random requests, shard line-ups and "
      "policy names) is the general check; it is a pytest test, not part of this run: "
      "`.venv/bin/python -m pytest -q tests/test_contract_capabilities.py "
      "tests/test_contract_golden.py`.")
    w("")

    # -- tests
    w("## Tests")
    w("")
    w("Not run by this pipeline; the tests of this story: `.venv/bin/python -m pytest -q "
      "tests/test_ownership.py tests/test_graph_reads.py tests/test_v4_flash.py "
      "tests/test_fixture.py tests/test_contract_capabilities.py "
      "tests/test_contract_golden.py tests/test_evidence_dgr065.py`. "
      "`tests/test_graph_reads.py` includes negative checks (a derivation wrong by one "
      "tensor, or one leaving out the unread V cache, fails); `tests/test_v4_flash.py` "
      "asserts the derivation time limit; `tests/test_evidence_dgr065.py` runs notebooks "
      "01_tensor_ownership and 02_state_contract on a short lane and regenerates this "
      "README from their metrics.")
    w("")

    # -- limitations
    w("## Limitations")
    w("")
    w(f"- The fixture is a tiny random-weight model ({fx['n_layer']} trunk layers + "
      f"{fx['n_mtp']} MTP block): it checks which tensors and caches upstream's graphs read "
      "and allocate, not anything about the real model's weights.")
    w("- **V4-Flash dtypes come from the converter mapping** (`CONVERTER_DTYPES` in "
      "`mtplib/model/arch.py`, following upstream's `conversion/deepseek.py`); the published "
      "checkpoint's own dtypes were not read (no network). Upstream loading the tables with "
      "`no_alloc` confirms shapes and sizes, not that a real conversion would pick exactly "
      "these types.")
    w("- **Cache bytes at real scale are formulas.** They were measured against upstream on "
      "the fixture only; at V4-Flash scale the same formulas are extrapolated: a context "
      "cannot be created on the `no_alloc` model (the scheduler aborts) and a weight-less "
      "file is refused for decoding by design. The CPU buffer alignment is assumed; a GPU "
      "buffer type may pad differently.")
    w("- The derivation times were measured once, on the machine above "
      f"({cpu.get('logical_cores')} logical cores, possibly shared with other jobs); they "
      "are a check against the limit, not a benchmark.")
    w("- `kv_unified=false` only (the C default); one MTP block only (upstream asserts "
      "`n_layer_nextn == 1`); replicas assume MTP runs on the last shard.")
    w("- The alpha-policy result above covers the fixtures' named line-ups; the general "
      "claim rests on the property test, which is not part of this run.")
    git = rec.get("git", {})
    if git.get("dirty"):
        w("- The run was made from a checkout with uncommitted changes "
          f"(`{git.get('commit')}` plus edits).")
    w("")

    # -- handoff
    w("## Handoff to DGR-066")
    w("")
    tail = reps[str(n_max)]
    rep_b = [r for r in tail if r["kind"] == "replica"]
    dup_b = [r for r in tail if r["kind"] == "duplicate"]
    w("- **Tail shard memory:** besides its layers, the shard holding the MTP sidecar "
      "carries " + "; ".join(f"the replica `{r['name']}` ({r['bytes']} bytes)" for r in rep_b)
      + ("; " if rep_b and dup_b else "")
      + "; ".join(f"the duplicate `{r['name']}` ({r['bytes']} bytes, "
                  + ("read by MTP" if r["read_by"] else "never read") + ")" for r in dup_b)
      + ". Sharing them with the trunk would need upstream support.")
    big = max(ctxs) if ctxs else None
    full = next((r for r in tot if r["n_ctx"] == big and r["swa_full"]), None)
    win = next((r for r in tot if r["n_ctx"] == big and not r["swa_full"]), None)
    if full and win:
        w(f"- **`swa_full`:** the C-API default (`true`) sizes the raw SWA cache to the "
          f"whole context: {full['raw_swa_k']} bytes at n_ctx {big} for the whole model "
          f"(cache total {full['total']}); ranged contexts should set `swa_full=false`: "
          f"{win['raw_swa_k']} bytes (total {win['total']}).")
        same_v = "an equal" if full["mtp_swa_v_unread"] == full["mtp_swa_k"] else "an"
        w(f"- **MTP context memory:** budget the MTP context at its K plus {same_v} unread "
          f"V (upstream allocates it): {full['mtp_swa_k']} + {full['mtp_swa_v_unread']} "
          f"bytes at n_ctx {big} with `swa_full=true`.")
    if "f32" in seam["per_seam"] and "bf16" in seam["per_seam"]:
        f32, bf16 = seam["per_seam"]["f32"], seam["per_seam"]["bf16"]
        w(f"- **Seam traffic per decode token** is `decode_token` only: {f32['decode_token']} "
          f"bytes in f32 or {bf16['decode_token']} in bf16, per seam; MTP on the tail adds "
          f"nothing (`mtp_hidden_remote` would be {f32['mtp_hidden_remote']} / "
          f"{bf16['mtp_hidden_remote']} bytes).")
    w("- **Reuse:** `mtplib inventory --json` and `mtplib.ownership.derivation.derive` give "
      "each shard its layer range, files, replicas and caches; "
      "`mtplib.runtime.graph_reads.check_pair` re-checks any new fixture against upstream.")
    w("")
    w("## How numbers are traced")
    w("")
    w(TRACE_RULE_DGR065)
    w("")
    return "\n".join(L)


WRITERS: dict[str, Callable[[Path, dict, _Links], str]] = {
    "DGR-066": _dgr066, "DGR-065": _dgr065}


def render_readme(run_dir: str | Path, story: str, out: str | Path) -> str:
    if story not in WRITERS:
        raise InputError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    run_dir = Path(run_dir)
    return WRITERS[story](run_dir, load_raw(run_dir, story), _Links(run_dir, Path(out)))


def write_evidence_readme(run_dir: str | Path, story: str = "DGR-066",
                          out: str | Path = Path("evidence/DGR-066/README.md")) -> Path:
    """Write the story's README generated from the run's raw metrics; refuses a README
    with a number that does not trace to them."""
    out = Path(out)
    text = render_readme(run_dir, story, out)
    missing = numbers_trace(text, load_raw(run_dir, story))
    if missing:
        raise InputError(f"{story} README: numbers not in the raw metrics: {missing}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


# -- copying a run into evidence/ ---------------------------------------------------------
_COPY_SUFFIXES = {".ipynb", ".json", ".csv", ".png"}


def run_files(run_dir: Path) -> list[Path]:
    """What a run contributes to evidence: executed notebooks, raw metrics, plots, the run
    record (relative paths). Generated models and the run's own evidence/ are left out."""
    out = [p.relative_to(run_dir) for p in sorted(run_dir.iterdir())
           if p.is_file() and p.suffix in _COPY_SUFFIXES]
    bench = run_dir / BENCH_DIR
    if bench.is_dir():
        out += [p.relative_to(run_dir) for p in sorted(bench.rglob("*"))
                if p.is_file() and p.suffix in _COPY_SUFFIXES]
    return out


def _dgr065_files(run_dir: Path) -> list[Path]:
    """DGR-065's part of a run: notebooks 01/02, their raw metrics, the run record."""
    return [Path(n) for n in (*DGR065_NOTEBOOKS, *DGR065_RAW, "run_record.json")
            if (run_dir / n).is_file()]


#: What ``mtplib evidence`` copies for a story (default: `run_files`, the whole run).
STORY_FILES: dict[str, Callable[[Path], list[Path]]] = {"DGR-065": _dgr065_files}


def copy_run(run_dir: str | Path, story: str = "DGR-066", dest: str | Path = "evidence",
             *, force: bool = False) -> Path:
    """Copy a run into ``dest/<story>/`` and write its README there; return the README.

    Refuses (FileExistsError, nothing written) to overwrite an existing file with different
    content unless ``force``."""
    run_dir, target = Path(run_dir), Path(dest) / story
    if not (run_dir / "run_record.json").exists():
        raise InputError(f"{run_dir} is not a run directory (no run_record.json)")
    if story not in WRITERS:
        raise InputError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    files = STORY_FILES.get(story, run_files)(run_dir)
    # render from a staging copy so the README's links point at the copied files
    staging = target.parent / f".{story}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        for rel in files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / rel, staging / rel)
        readme = write_evidence_readme(staging, story, staging / "README.md")
        new = [*files, Path(readme.name)]
        clash = [str(target / rel) for rel in new if (target / rel).exists()
                 and (target / rel).read_bytes() != (staging / rel).read_bytes()]
        if clash and not force:
            raise WouldOverwrite(
                f"{len(clash)} file(s) in {target} differ from this run (e.g. {clash[0]}); "
                "pass --force to overwrite")
        for rel in new:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(staging / rel, target / rel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "README.md"
