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
# # 05 · Ranged MTP over a WAN (issue 14)
#
# The trained tiny V4 pair split over local RPC shards, each behind a relay that emulates a
# WAN link (half the round trip each way, chunks pipelined). For every plan, topology
# (`remote`: every shard behind the WAN; `tail_local`: the tail shard co-located with the
# client) and drafter placement (MTP on the `tail` shard or in the `client`), tokens/s against
# RTT for MTP off and k = 1..3, with the waits (synchronous round trips) per step kind, bytes
# by class, and the cache bytes that crossed a shard connection (the contract says 0).
#
# It runs once per upstream build: `stock` and `patched` (patches/*.patch: the V4
# compressor-state restore pinned to its layer's shard), each in its own process.
#
# Two measurements: the RTT sweep (`wan`) and the target cells (`target`: many prompts at
# one RTT), each in `warm` mode (one loaded `RangedMTP`, the object `mtplib serve` holds)
# and/or `cold` mode (one `mtplib generate` process per generation with default options;
# `cold_shards: endpoints` runs it against `mtplib shard serve` processes on this host, as a
# user tries shards first). Every RTT is crossed with the link bandwidths `mbits` (Mbit/s
# per direction of each WAN link, `null` = unlimited).
#
# A run that stops (a session's end, Ctrl-C) resumes: run the notebook again with the same
# `run_dir`; every finished cell is kept as it is and only the missing ones are measured (a
# folder measured with another build or other per-run settings is refused).

# %% tags=["parameters"]
from typing import Optional

run_dir: Optional[str] = None  # None: a new scratch folder in outputs/scratch/; an earlier
# run's folder: resume it
# mtplib.lab.wan.config.WanConfig fields (a lane passes its `wan:`); {}: the full default sweep.
# This default is a short run (as the cpu-fixture lane's): 2 shards, 0 and 50 ms, k 0 and 2
wan: dict = {"rtts_ms": [0, 50], "ks": [0, 2], "plans": ["0-1,2-3"], "topologies": ["remote"],
             "placements": ["client"], "n_prompts": 1, "prompt_len": 32, "n_new": 12,
             "fit_rtts_ms": [0, 50]}  # the RTT sweep's WanConfig fields ({}: the full default)
target: Optional[dict] = None  # the target cell's WanConfig fields; None: skip
builds: list[str] = ["stock", "patched"]  # upstream builds to run, each in its own process
overrides: dict = {}  # build -> WanConfig fields for that build only
threads: int = 1  # CPU threads
progress: bool = True  # a tqdm progress bar per build

# %%
# the parameters checked (-p strings parsed, ranges, no unknown -p name): a bad one stops here
from mtplib.records.parameters import checked

globals().update(checked(globals()))

# %%
import pandas as pd
from IPython.display import display

from mtplib.lab.common import display as D
from mtplib.lab.wan.builds import run_builds
from mtplib.lab.wan.config import WanConfig
from mtplib.lab.wan.plots import plot_bandwidth
from mtplib.records.scratch import notebook_run

pd.set_option("display.width", 200)
pd.set_option("display.precision", 3)
out = notebook_run("05_wan", run_dir, models=False).run_dir  # the trained pair: read in place
cfg = WanConfig.from_dict(wan)
cfg

# %%
results = run_builds(cfg, out / "wan", builds=builds, overrides=overrides, log=print,
                     progress=progress)
targets = {}
if target is not None:
    targets = run_builds(WanConfig.from_dict(target), out / "wan-target", builds=builds,
                         overrides=overrides, log=print, progress=progress)
list(results), list(targets)

# %% [markdown]
# ## The path users take (target cell)
# Cold (a fresh CLI process per run, default options) and warm (one loaded runtime): n runs,
# medians with their range, the paired speed-up, waits per verify vs plain step.

# %%
for build, d in targets.items():
    print(build)
    display(D.show(d["targets"]))
    display(D.show(pd.DataFrame(d["summary"]), ["mode", "plan", "topology", "mbit",
                                                "placement", "k", "runs",
                                                "tok_s", "tok_s_min", "tok_s_max",
                                                "speedup_paired_median", "speedup_paired_min",
                                                "speedup_paired_max", "tokens_per_step",
                                                "ttft_s", "setup_s", "process_wall_s",
                                                "waits_per_verify", "waits_per_plain",
                                                "cache_bytes_crossing", "identical_to_off"]))

# %% [markdown]
# ## Speed-up against the link bandwidth (target cells)
# At the targets' RTT, one line per topology and draft length; the unlimited link on the
# right.

# %%
import matplotlib.pyplot as plt

for build, d in targets.items():
    for mode in sorted({x["mode"] for x in d["summary"]}):
        for plan in sorted({x["plan"] for x in d["summary"]}):
            ax = plot_bandwidth(d["summary"], plan=plan, rtt_ms=100, mode=mode)
            if ax is not None:
                ax.set_title(f"{build}: {ax.get_title()}", fontsize=9)
                plt.show()

# %% [markdown]
# ## Tokens/s and speed-up against RTT
# One line per topology, placement and draft length; `MTP off` is the same connections
# without drafting. The speed-up a WAN-bound loop approaches is the tokens per verify step.

# %%
from IPython.display import Image

from mtplib.records.wan_evidence import save_plots

for p in save_plots(results, out):  # stock and patched on the same axes, saved as PNGs
    print(p.relative_to(out))
    display(Image(filename=str(p)))

# %% [markdown]
# ## The targets at 100 ms (plan 0-1,2-3, k=2)
# `ratio` = speed-up over MTP off / tokens per verify step (goal >= 0.85 with the tail
# co-located, >= 0.70 with every shard remote and the drafter in the client);
# `extra waits/verify` = waits of a verify step minus those of a plain step.

# %%
for build, d in results.items():
    print(build)
    display(D.show(d["targets"]))

# %% [markdown]
# ## Waits per step kind and bytes per step by class

# %%
for build, d in results.items():
    s = pd.DataFrame(d["summary"])
    top = s[s.rtt_ms == s.rtt_ms.max()]
    print(build)
    display(D.show(top, ["plan", "topology", "mbit", "placement", "k", "tok_s", "speedup",
                         "tokens_per_step", "waits_per_plain", "waits_per_verify",
                         "waits_per_draft", "waits_per_token", "cache_bytes_crossing",
                         "identical_to_off"]))
    b = pd.DataFrame(d["bytes_by_class"])
    display(D.show(b[b.step.isin(["decode", "verify", "draft", "feed", "rollback"])]))

# %% [markdown]
# ## The cost model
# `s/token = compute + RTT x waits`, fitted per configuration on the lower RTTs and checked
# on the others; the fitted waits sit next to the measured ones.

# %%
for build, d in results.items():
    print(build)
    display(D.show(d["cost_model"]))
