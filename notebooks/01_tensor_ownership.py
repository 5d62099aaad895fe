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
# # 01 · Tensor ownership (DGR-065)
#
# Every tensor of a DeepSeek-V4 trunk and its `mtp-` sidecar gets a role (head, main_layer,
# tail, mtp), the graphs that read it (main, mtp, both or none) and a shard under a plan of
# contiguous layer ranges: derived from the GGUF headers alone (`mtplib.ownership.derivation`), then
# **checked against the graphs upstream builds**: one main decode and one MTP decode with
# the context's eval callback record every weight tensor read, and any difference stops the
# notebook. The same derivation then runs on the weight-less DeepSeek-V4-Flash table (real
# tensor table and dtypes, no weights) for 2, 4 and 8 shards.

# %% tags=["parameters"]
from typing import Optional

trunk: Optional[str] = None  # trunk GGUF; None: generate the built-in fixture
sidecar: Optional[str] = None  # its mtp- sidecar (set both or neither)
threads: int = 2  # CPU threads
run_dir: Optional[str] = None  # None: a new scratch folder in outputs/scratch/
plan: str = "0-1,2-3"  # shard plan for the fixture (contiguous layer ranges)
ctx: int = 4096  # context (llama n_ctx) for the cache columns
flash_dir: Optional[str] = None  # V4-Flash table folder; None: run_dir/models/v4-flash
flash_shards: list[int] = [2, 4, 8]  # V4-Flash shard counts to derive
flash_ctx: int = 131072  # context for the V4-Flash cache column
dspark: Optional[str] = None  # DSpark draft of the trunk; None: the tiny fixture's random one

# %%
# the parameters checked (-p strings parsed, ranges, no unknown -p name): a bad one stops here
from mtplib.records.parameters import checked

globals().update(checked(globals()))

# %%
from pathlib import Path

import pandas as pd

from mtplib.model.fixture import write_combined, write_fixture
from mtplib.ownership import report as rep
from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths
from mtplib.records.scratch import notebook_run
from mtplib.runtime.graph_reads import check_pair, table_check

pd.set_option("display.width", 220)
pd.set_option("display.max_columns", 30)
nb = notebook_run("01_tensor_ownership", run_dir, trunk, sidecar)
run_dir, trunk, sidecar = nb.run_dir, nb.trunk, nb.sidecar
inv = inventory_from_paths(trunk, sidecar)
own = derive(inv, plan, CacheParams(n_ctx=ctx))
cfg = inv.config
print(f"{inv.layout}: {cfg.n_layer} trunk layers + {cfg.n_mtp} MTP block, plan {own.plan}")
rep.role_table(own)

# %% [markdown]
# Shipped but read by no graph (reported, not hidden):

# %%
rep.unread_table(own)

# %% [markdown]
# ## Checked against upstream: the weights each graph reads
#
# `check_pair` runs one main decode on the trunk and one MTP decode on the sidecar, each with
# `cb_eval` watching every graph node and its sources, and compares the weights seen with the
# derived `read_by` of each file's tensors. Then the same for one file holding trunk and MTP
# (upstream's single-file layout, loaded with `load_mtp`).

# %%
check = check_pair(inv, CacheParams(n_ctx=ctx))
combined_path = write_combined(trunk, sidecar, Path(run_dir) / "models" / "combined")
combined = inventory_from_paths(combined_path)
check_c = check_pair(combined, CacheParams(n_ctx=ctx))
assert check["reads_equal"] and check_c["reads_equal"], (check["reads"], check_c["reads"])
pd.concat([rep.reads_check_table(check).assign(layout="pair"),
           rep.reads_check_table(check_c).assign(layout="combined")], ignore_index=True)

# %%
rep.role_table(combined)

# %% [markdown]
# ## Shards of the fixture

# %%
rep.shard_table(own)

# %%
rep.replica_table(own)

# %%
from mtplib.lab.common.display import model_name

fig = rep.stacked_bytes_chart({f"plan {own.plan}": own}, "roles", unit=2**20,
                              title=f"{model_name(trunk)}: bytes held per shard, by tensor role")

# %% [markdown]
# ## DSpark beside MTP: the draft's parts, checked against its two graphs
#
# DeepSeek-V4-Flash's release drafts with DSpark (GGUF arch `dflash` + `markov_w1`). From
# the draft's header and the trunk's (`mtplib.ownership.dspark`) each draft tensor gets a
# part (a stage, the feature fusion `fc` + `enc.output_norm`, the Markov head, the
# confidence head, the draft's hc head + output norm) and the graphs that read it: the embd
# batch (`inject`: the target's features through `fc` into each stage's K) and the token
# batch (`block`: the noise block through the stages and both heads). The token embedding
# and the output head are the trunk's, read through `ctx_other`. Then one embd batch and one
# noise block on the runtime's own draft context, with `cb_eval`, record what upstream's
# graphs read; any difference, or a read whose part says another graph, stops the notebook.

# %%
from mtplib.model.dspark.fixture import write_dspark_fixture
from mtplib.ownership.dspark import derive_dspark_from_paths
from mtplib.runtime.dspark.graph_reads import check_dspark

dspark = dspark or str(write_dspark_fixture(Path(run_dir) / "models" / "dspark", seed=0))
dsp = derive_dspark_from_paths(dspark, trunk, plan, CacheParams(n_ctx=ctx))
dcheck = check_dspark(dsp, CacheParams(n_ctx=ctx))
assert dcheck["reads_equal"] and dcheck["parts_consistent"], (dcheck["reads"],
                                                              dcheck["part_contradictions"])
print(f"{Path(dspark).name}: {dsp.config.n_stages} stages, target layers "
      f"{list(dsp.config.target_layers)} (the outputs of trunk layers "
      f"{[t - 1 for t in dsp.config.target_layers]}), block size {dsp.config.block_size}")
pd.DataFrame(dcheck["reads"])

# %%
pd.DataFrame(dsp.parts())

# %% [markdown]
# Where each feature is made and which shards see it under the plan, and what the draft
# needs where it runs (in the client, or on the tail shard):

# %%
pd.DataFrame([f.to_json() for f in dsp.features])

# %%
pd.DataFrame([{k: v for k, v in p.to_json().items() if k != "caches"}
              for p in dsp.placements])

# %% [markdown]
# ## DeepSeek-V4-Flash: the real tensor table, weight-less
#
# `mtplib fixture --preset v4-flash` writes the trunk and sidecar tables of the published
# config with the dtypes upstream's converter writes (MXFP4 experts, Q8_0 for the FP8
# weights, BF16, F32, I32 hash tables); the data region is a sparse hole, so 150 GB of
# tensors take a few MB of disk. Headers are read in milliseconds, nothing else.

# %%
fdir = Path(flash_dir) if flash_dir else Path(run_dir) / "models" / "v4-flash"
flash = write_fixture(fdir, preset="v4-flash")
s = flash.summary()
pd.DataFrame([{"file": Path(s[k]["path"]).name, "logical bytes": s[k]["bytes"],
               "disk bytes": s[k]["disk_bytes"], "sha256 (header)": s[k]["sha256_header"][:16]}
              for k in ("trunk", "sidecar")])

# %%
limit_s = 5  # the acceptance criterion: headers + derivations in under 5 s
owns, secs = rep.flash_ownerships(str(flash.trunk), str(flash.sidecar), shards=flash_shards,
                                  ctxs=[flash_ctx], swa_full=[True])
print(f"read 2 headers + {len(owns)} derivations: {secs:.3f} s")
assert secs < limit_s, secs
finv = next(iter(owns.values())).inventory
rep.role_table(finv)

# %% [markdown]
# Upstream's own loader accepts the table: each file is loaded with `no_alloc` (metadata
# only, no weight read, nothing allocated; in a child process) and the model size it
# computes is compared with the inventory's bytes.

# %%
tc = pd.DataFrame(table_check(finv))
assert tc["equal"].all(), tc
tc

# %%
shards = pd.concat([rep.shard_table(owns[(n, flash_ctx, True)]) for n in flash_shards],
                   ignore_index=True)
mtp_block = owns[(flash_shards[0], flash_ctx, True)].mtp_block_bytes
print(f"MTP block (blk.43.*): {mtp_block} bytes = {mtp_block / 2**30:.3f} GiB")
shards

# %%
rep.replica_table(owns[(flash_shards[-1], flash_ctx, True)])

# %% [markdown]
# Equal layer counts leave the last shard heaviest (tail + MTP sidecar). A byte-balanced
# plan (contiguous ranges minimising the largest shard, `ownership.balanced_plan`):

# %%
from mtplib.ownership.derivation import balanced_plan
from mtplib.ownership.plan import even_plan

plans = pd.DataFrame([{"shards": n, "plan": kind, "ranges": str(p),
               "largest shard GiB": round(max(s.bytes for s in derive(finv, p).shards) / 2**30, 3)}
              for n in flash_shards
              for kind, p in (("even", even_plan(43, n)), ("balanced", balanced_plan(finv, n)))])
plans

# %%
fig = rep.stacked_bytes_chart({f"{n} shards (even layer split)": owns[(n, flash_ctx, True)]
                               for n in flash_shards},
                              "roles", title="DeepSeek-V4-Flash: bytes held per shard, by role")

# %%
# raw metrics of this notebook (the DGR-065 evidence README is generated from them)
from mtplib.records import raw_metrics as RM

record = RM.ownership_record(
    fixture=own, combined=combined, ctx=ctx, reads={"pair": check, "combined": check_c},
    flash=owns, flash_files=flash.summary(), flash_ctx=flash_ctx, flash_shards=flash_shards,
    seconds=secs, limit_s=limit_s, table_check=tc, plans=plans, dspark=dsp,
    dspark_check=dcheck)
_ = RM.write_ownership(run_dir, record)
