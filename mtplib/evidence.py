"""Evidence READMEs generated from a run's raw metrics, and the check that they only say
what the metrics say.

- `write_evidence_readme(run_dir, story, out)`: the README of a story, every number
  formatted from the run's raw metrics (``bench/bench.json`` and ``run_record.json``).
- `numbers_trace(text, raw)`: the numbers in a README that do not appear in the raw metrics
  (the rule is `TRACE_RULE`, also printed at the end of every README).
- `copy_run(run_dir, story, dest)`: what ``mtplib evidence`` does: copy a run's executed
  notebooks, raw metrics, plots and run record into ``evidence/<story>/`` and write the
  README there (refusing to overwrite a different file unless forced).

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


def load_raw(run_dir: str | Path) -> dict:
    """The raw metrics a README may cite: the bench metrics and the run record."""
    run_dir = Path(run_dir)
    raw = {"run_record": json.loads((run_dir / "run_record.json").read_text())}
    bench = run_dir / BENCH_DIR / "bench.json"
    if bench.exists():
        raw["bench"] = json.loads(bench.read_text())
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
        raise ValueError(f"{run_dir}: no {BENCH_DIR}/bench.json: the lane did not run the "
                         "benchmark (notebook 04_benchmark)")
    b = raw["bench"]
    cfg = b["config"]
    summ = [r for r in b["summary"] if r["plan"] == "whole"]
    off = next(r for r in summ if r["k"] == 0)
    on = [r for r in summ if r["k"] > 0]
    models = rec.get("models", {})
    sha = rec.get("model_sha256", {})
    gpus = rec.get("gpu") or []
    backend = b.get("backend", {})
    notebooks = [n["notebook"] for n in rec.get("notebooks", [])]
    L: list[str] = []
    w = L.append

    w("# DGR-066 part 3: MTP off vs on benchmark and the evidence pipeline")
    w("")
    w(f"Generated by `mtplib.evidence` from the raw metrics of run `{Path(rec['run_dir']).name}` "
      f"({link(BENCH_DIR + '/bench.json')}, {link('run_record.json')}). Do not edit: "
      "`mtplib evidence --run RUN_DIR --story DGR-066` rewrites it, and "
      "`tests/test_bench.py` checks that every number here appears in those files "
      "(rule at the end).")
    w("")
    w("## The run")
    w("")
    git = rec.get("git", {})
    pins = rec.get("pins", {})
    cpu = rec.get("cpu", {})
    rows = [
        ["command", f"`{rec.get('command')}`"],
        ["lane", f"`{rec.get('lane')}` (`{rec.get('params_file')}`)"],
        ["git commit", f"`{git.get('commit')}` (uncommitted changes: `{git.get('dirty')}`)"],
        ["pins", f"`llama-cpp-python=={pins.get('llama_cpp_python')}`, llama.cpp "
                 f"`{pins.get('llama_cpp_commit')}`, `{pins.get('cmake_args')}`"],
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
    for key, path in models.items():
        name = Path(path).name
        rows.append([f"model: {key}", f"`{name}` sha256 `{sha.get(path, '?')}`"])
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
      "`mtplib.quality`):")
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
        w(f"The drafter proposes the target's own MTP-off continuation, each draft position "
          f"replaced by a wrong token with probability 1 − rate (the same rate at every "
          f"position); {cost}. {sc['reps']} measured repetitions per prompt after "
          f"{sc['warmup']} warm-up. Speed-up = median decode tok/s ÷ median MTP-off decode "
          f"tok/s ({_f(off['decode_tok_s_median'])}). Only speed counts here: the sweep's "
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
          "yet (`mtplib.bench._run_ranged`); seam bytes per token are therefore not "
          "measured: the whole model has no seam.")
    w("- The GPU and real-model lanes were not run in this run.")
    w("")
    w("## How numbers are traced")
    w("")
    w(TRACE_RULE)
    w("")
    return "\n".join(L)


WRITERS: dict[str, Callable[[Path, dict, _Links], str]] = {"DGR-066": _dgr066}


def render_readme(run_dir: str | Path, story: str, out: str | Path) -> str:
    if story not in WRITERS:
        raise ValueError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    run_dir = Path(run_dir)
    return WRITERS[story](run_dir, load_raw(run_dir), _Links(run_dir, Path(out)))


def write_evidence_readme(run_dir: str | Path, story: str = "DGR-066",
                          out: str | Path = Path("evidence/DGR-066/README.md")) -> Path:
    """Write the story's README generated from the run's raw metrics; refuses a README
    with a number that does not trace to them."""
    out = Path(out)
    text = render_readme(run_dir, story, out)
    missing = numbers_trace(text, load_raw(run_dir))
    if missing:
        raise ValueError(f"{story} README: numbers not in the raw metrics: {missing}")
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


def copy_run(run_dir: str | Path, story: str = "DGR-066", dest: str | Path = "evidence",
             *, force: bool = False) -> Path:
    """Copy a run into ``dest/<story>/`` and write its README there; return the README.

    Refuses (FileExistsError, nothing written) to overwrite an existing file with different
    content unless ``force``."""
    run_dir, target = Path(run_dir), Path(dest) / story
    if not (run_dir / "run_record.json").exists():
        raise ValueError(f"{run_dir} is not a run directory (no run_record.json)")
    if story not in WRITERS:
        raise ValueError(f"no evidence README writer for story {story!r} "
                         f"(known: {sorted(WRITERS)})")
    files = run_files(run_dir)
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
            raise FileExistsError(
                f"{len(clash)} file(s) in {target} differ from this run (e.g. {clash[0]}); "
                "pass --force to overwrite")
        for rel in new:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(staging / rel, target / rel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "README.md"
