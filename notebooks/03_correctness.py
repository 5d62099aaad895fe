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
# # 03 · MTP correctness (DGR-066 part 1)
#
# The MTP runtime against its contract on the lane's trunk and `mtp-` sidecar:
# MTP-on vs MTP-off output (with the near-tie audit), forced accept / reject accounting,
# rollback exactness (tail removal and checkpoint restore + replay), interleaved sessions,
# and sampling (sample-and-match). Every table comes from `mtplib.lab.correctness`.

# %% tags=["parameters"]
trunk = None
sidecar = None
threads = 2
run_dir = "."
seeds = 20
ks = [1, 2, 3]
n_new = 32
plans = ["0-1,2-3", "0-0,1-2,3-3"]

# %%
import pandas as pd

from mtplib.lab import correctness as C
from mtplib.lab import correctness_plots as CP
from mtplib.lab import display as D
from mtplib.lab.quality import NOISE_BOUND
from mtplib.records import raw_metrics as RM

assert trunk and sidecar, "run through `mtplib run` or set trunk/sidecar"

# %% [markdown]
# ## MTP on vs off (greedy), per prompt seed and draft length

# %%
eq = pd.DataFrame(C.equality(trunk, sidecar, seeds=range(seeds), ks=ks, n_new=n_new,
                             n_threads=threads))
summary = eq.groupby("k").agg(runs=("equal", "size"), equal=("equal", "sum"),
                              near_tie_divergences=("near_tie", "sum"),
                              drafted=("drafted", "sum"), accepted=("accepted", "sum"))
summary["unexplained_divergences"] = summary.runs - summary.equal - summary.near_tie_divergences
D.show(summary)

# %%
D.show(eq[~eq.equal])  # every divergence, with the MTP-off top-2 margin where it happened

# %% [markdown]
# ## Forced accept and forced reject: exact accounting

# %%
fo = pd.DataFrame(C.forced(trunk, ks=ks, n_new=n_new, n_threads=threads))
D.show(fo)

# %% [markdown]
# ## Rollback exactness: next logits vs a fresh context (noise bound 0.005)

# %%
rb = pd.DataFrame(C.rollback_noise(trunk, n_threads=threads))
D.show(rb)

# %% [markdown]
# ## Interleaved sessions vs each alone

# %%
se = pd.DataFrame(C.sessions(trunk, sidecar, n_threads=threads))
D.show(se)

# %% [markdown]
# ## Sampling: MTP-on vs MTP-off streams per seed (sample-and-match)

# %%
sa = C.sampling_agreement(trunk, sidecar, n_threads=threads)
D.show([sa])

# %% [markdown]
# ## Whole vs ranged (DGR-066 part 2)
#
# The trunk's layers on loopback RPC shard processes (plan per row), the MTP sidecar on the
# tail shard; bytes on every shard connection counted by relays, per token per step kind,
# next to the contract's minimum per decode token. The same table goes into the run record.

# %%
wr = pd.DataFrame(C.whole_vs_ranged(trunk, sidecar, plans=plans, n_threads=threads))
_ = RM.write_seam_bytes(run_dir, wr)  # the run record carries it, even if a later cell fails
D.show(wr)

# %% [markdown]
# For scale: the contract's minimum per token per seam for DeepSeek-V4-Flash at bf16 (the
# hc*n_embd boundary row plus the token id), from the DGR-065 derivation.

# %%
from mtplib.contract import V4_FLASH_DIMS, DType, seam_bytes_per_token

flash = seam_bytes_per_token(V4_FLASH_DIMS, DType.BF16)
D.show([{"model": "V4-Flash", "dtype": "bf16", **{k: flash[k] for k in
               ("prefill_token", "decode_token", "verify_k1", "verify_k2", "verify_k3")}}])

# %% [markdown]
# Bytes per token on the shard connections by step kind, per plan (log scale). A step kind
# without a bar did not occur in that run (MTP off drafts nothing) or moved no counted bytes:
# the table above shows it as n/a, never 0.

# %%
D.as_image(CP.plot_seam_traffic(wr, model=D.model_name(trunk)))

# %%
D.as_image(CP.plot_rollback(rb, noise_bound=NOISE_BOUND, model=D.model_name(trunk)))

# %%
# raw metrics of this notebook: every table above
_ = RM.write_correctness(run_dir, RM.correctness_record(
    equality=eq, forced=fo, rollback=rb, sessions=se, sampling=sa, whole_vs_ranged=wr))
