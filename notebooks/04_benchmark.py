# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: mtplib (.venv)
#     language: python
#     name: mtplib
# ---

# %% [markdown]
# # 04 · MTP off vs on benchmark (DGR-066 part 3)
#
# For the lane's trunk and `mtp-` sidecar: MTP off and MTP on (k = 1..3) per plan, with
# warm-up runs excluded and repetitions for the spread; quality against MTP off; acceptance
# overall, per draft position and as a histogram; TTFT and decode speed; the time split;
# memory; seam bytes. Then the synthetic acceptance sweep: the target's own continuation,
# cut at a length drawn with upstream's `--spec-synth-rates` semantics, gives the speed-up
# at acceptance 0..100% and the break-even acceptance, with the published reference numbers
# marked (their sources, with links, in the table at the end of the sweep section).
# Everything comes from `mtplib.lab.bench`; raw rows go to `run_dir/bench/` (JSON + CSV).
# Opened on its own it generates the fixture into a scratch run folder under
# `outputs/scratch/` and runs a small bench (about a minute); a lane passes its `bench:`.

# %% tags=["parameters"]
from typing import Optional

trunk: Optional[str] = None  # trunk GGUF; None: generate the built-in fixture
sidecar: Optional[str] = None  # its mtp- sidecar (set both or neither)
threads: int = 2  # CPU threads
run_dir: Optional[str] = None  # None: a new scratch folder in outputs/scratch/
# the lane's `bench:` section (mtplib.lab.bench.config.BenchConfig); this default is a small one
bench: dict = {"ks": [1, 2], "n_new": 16, "reps": 1, "warmup": 1, "threads": 1,
               "sweep": {"rates": [0.0, 0.5, 1.0], "ks": [1, 2], "reps": 1,
                         "warmup": 0}}  # BenchConfig fields (a lane's bench:)
progress: bool = True  # a tqdm progress bar over the bench's generations
sbs_dir: str = "evidence/side-by-side"  # committed side-by-side results (repo-relative)

# %%
# the parameters checked (-p strings parsed, ranges, no unknown -p name): a bad one stops here
from mtplib.records.parameters import checked

globals().update(checked(globals()))

# %%
import pandas as pd
from IPython.display import Image, Markdown, display

from mtplib.lab.bench.config import BenchConfig
from mtplib.lab.bench.measure import run_bench
from mtplib.lab.common import display as D
from mtplib.records import raw_metrics as RM
from mtplib.records.scratch import notebook_run

nb = notebook_run("04_benchmark", run_dir, trunk, sidecar)
run_dir, trunk, sidecar = nb.run_dir, nb.trunk, nb.sidecar
cfg = BenchConfig.from_dict(bench, threads=threads)
result = run_bench(trunk, sidecar, cfg, progress=progress)
paths = RM.write_bench(run_dir, result)
data = RM.read_bench(run_dir)
summ = pd.DataFrame(data["summary"])
def plot(name):  # the PNG saved with the raw metrics (bench/plots/), as the evidence shows it
    display(Image(filename=str(paths[f"plot_{name}"])))
D.show([{"bench wall s": data["wall_s"], **{k: v for k, v in
        data["config"].items() if k not in ("sweep", "sampling")}}])

# %% [markdown]
# ## Speed: MTP off vs on (median over repetitions, warm-up excluded)

# %%
D.show(summ, ["plan", "k", "runs", "decode_tok_s_median", "decode_tok_s_min",
             "decode_tok_s_max", "decode_tok_s_spread_pct", "speedup", "ttft_ms_median"])

# %%
plot('speed_vs_k')

# %% [markdown]
# ## Acceptance: overall, per draft position, accepted-length histogram

# %%
acc = summ[summ.k > 0][["plan", "k", "drafted", "accepted", "acceptance", "acceptance_pos_1",
                        "acceptance_pos_2", "acceptance_pos_3", "mean_accept_len"]]
# accepted-length histogram: runs' verify steps that accepted 0..k drafts, per plan and k
# (n/a: more than k cannot be accepted)
hist = pd.DataFrame([{"plan": r["plan"], "k": r["k"],
                      **{f"{a} accepted": n for a, n in r["accept_len_hist"].items()}}
                     for r in data["summary"] if r["k"] > 0])
display(D.show(acc), D.show(hist, index=["plan", "k"]))

# %%
plot('acceptance_per_position')

# %% [markdown]
# ## Quality against MTP off (greedy with near-tie allowance; sampling)

# %%
qcols = ["plan", "k", "runs", "equal_to_off_runs", "token_agreement_pct",
         "near_tie_divergences", "unexplained_divergences"]
qcols += [c for c in ("sampling_equal_streams", "sampling_streams", "sampling_tv_distance")
          if c in summ]
D.show(summ[summ.k > 0], qcols)

# %% [markdown]
# ## Where the time goes (ms per generated token)

# %%
parts = ["prefill", "draft", "verify", "feed", "rollback"]
D.show(summ, ["plan", "k"] + [f"ms_per_token_{p}" for p in parts]
       + [f"share_{p}_pct" for p in parts])

# %%
plot('time_split')

# %% [markdown]
# ## Memory and seam bytes

# %%
D.show(summ, ["plan", "k", "rss_peak_mib", "trunk_weights_mib", "mtp_weights_mib",
             "target_seq_state_kib", "mtp_seq_state_kib", "seam_bytes_per_token"])

# %%
plot('seam_bytes')

# %% [markdown]
# ## Acceptance sweep: speed-up vs acceptance, break-even
#
# Synthetic drafts (only speed is valid here). The x axis is the measured acceptance at
# draft position 1; diamonds mark where this lane's own MTP sits.

# %%
sw = pd.DataFrame(data["sweep"])
display(D.show(sw, ["plan", "k", "rate", "acceptance_pos_1", "acceptance",
                   "decode_tok_s_median", "speedup", "reference_intact_runs", "runs"])
        if len(sw) else "sweep off", D.show(data["break_even"]))

# %%
plot('speedup_curve')

# %% [markdown]
# Reference numbers, not measured here, and where each is published:

# %%
display(D.show([{"reference": k, **v} for k, v in data["reference_s9"].items()]),
        D.references_table())

# %% [markdown]
# ## Real acceptance: the trained tiny V4 (issue 9) next to the anchors
#
# Random-weight fixtures accept about 1/vocab. The committed trained pair
# (`evidence/trained-v4/`, MTP head trained jointly with DeepSeek's objective) gives real
# acceptance per position on held-out text, measured by `python -m mtplib.lab.trained_eval`
# (greedy, 32 held-out prompts x 128 tokens, 1 thread); the reference anchors are the
# published numbers above (DeepSeek-V3: 85-90% second-token acceptance, the midpoint shown;
# vLLM V4).
# At this size MTP on is slower than off (speed-up < 1): a verify step costs more than the
# tokens it saves. Read these acceptances against the sweep's speed-up curve above.

# %%
from mtplib.lab.trained_eval import anchor_table

D.show(anchor_table())

# %% [markdown]
# ## Side by side with upstream's C++ MTP loop (issue 7, preset `v4-ratio-cpu`)
#
# Committed results from `mtplib compare-upstream` (opt-in, not part of CI; commands in each
# file's `argv` and in `evidence/side-by-side/README.md`). Upstream side: `llama-server`
# built from the pinned sdist, `--spec-type draft-mtp -md SIDECAR --spec-draft-n-max k
# [--spec-synth-rates ...]`, the prompt sent as token ids. mtplib side: `MTPRuntime`, same
# files, threads, context, batch, KV type, k, rates and seed. Each case: a warm-up per side,
# then interleaved A/B runs; decode tok/s medians; ratio = mtplib / upstream (goal >= 0.9).
# The machine has 2 shared vCPUs, so the 1-minute load average is shown next to every case.

# %%
from mtplib.lab.sidebyside.cost import cost_ratio_table
from mtplib.lab.sidebyside.measure import evidence_dir
from mtplib.lab.sidebyside.runs import table as side_by_side_table
from mtplib.lab.sidebyside.sweep import sweep_table
from mtplib.lab.sidebyside.sweep_plots import plot_sweeps

sbs = evidence_dir(sbs_dir)
if not sbs.is_dir():
    print(f"no side-by-side results in {sbs}")
for p in sorted(sbs.glob("sbs-*.json")):
    display(Markdown(f"**{p.name}**"), D.show(side_by_side_table(p)))

# %% [markdown]
# Plain decoding repeated (the case whose ratio moves most with the load):

# %%
reps = sorted(sbs.glob("plain-repeat-*.json"))
D.show(pd.concat([side_by_side_table(p).assign(file=p.name) for p in reps])) if reps else "none"

# %% [markdown]
# ### The preset's cost ratio: one MTP step against one trunk step
#
# Median one-token `llama_decode` time of the MTP context over the trunk's, 300 tokens,
# interleaved token by token (`compare-upstream --cost-ratio-only`). DeepSeek-V4-Flash's
# MTP block is about 1/43 of its active compute; the `tiny` fixture's is about 1/5.

# %%
D.show(cost_ratio_table(sorted(sbs.glob('cost-ratio-*.json'))))

# %% [markdown]
# ### Acceptance -> speed on `v4-ratio-cpu`, break-even acceptance
#
# The MTP block drafts every step (its real cost); acceptance is synthetic with upstream's
# `--spec-synth-rates` semantics at the same rate at every position; MTP-off runs are
# interleaved with every k. Break-even = where the speed-up crosses 1.

# %%
sweeps = sorted(sbs.glob("sweep-*.json"))
for p in sweeps:
    sw, be = sweep_table(p)
    display(Markdown(f"**{p.name}**"), D.show(sw), D.show(be))
if sweeps:
    display(D.as_image(plot_sweeps(sweeps)))
