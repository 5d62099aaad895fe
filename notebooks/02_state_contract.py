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
# # 02 · State contract: caches per shard (DGR-065)
#
# Which caches each shard allocates for a context (raw SWA K, CSA/HCA compressed K, indexer
# K, compressor states, the MTP block's K), with their bytes: derived from the headers and
# the context parameters (`mtplib.ownership.derivation.cache_tensors`), then **compared with what
# upstream allocates** for the same context on the fixture (every cache tensor the graphs
# touch, and the exact size of every cache buffer). Then the same derivation for
# DeepSeek-V4-Flash at 8k, 128k and 1M context over 2, 4 and 8 shards, and the seam bytes
# per token of the MTP contract. All caches are shard-local: none crosses a seam.

# %% tags=["parameters"]
from typing import Optional

trunk: Optional[str] = None  # trunk GGUF; None: generate the built-in fixture
sidecar: Optional[str] = None  # its mtp- sidecar (set both or neither)
threads: int = 2  # CPU threads
run_dir: Optional[str] = None  # None: a new scratch folder in outputs/scratch/
plan: str = "0-1,2-3"  # shard plan for the fixture (contiguous layer ranges)
ctx: int = 4096  # context (llama n_ctx) of the first checked context
n_seq: int = 1  # sequences of the first checked context
flash_dir: Optional[str] = None  # V4-Flash table folder; None: run_dir/models/v4-flash
flash_shards: list[int] = [2, 4, 8]  # V4-Flash shard counts to derive
flash_ctxs: list[int] = [8192, 131072, 1048576]  # V4-Flash contexts to derive
golden_dir: Optional[str] = None  # contract golden files; None: tests/golden/contract
dspark: Optional[str] = None  # DSpark draft of the trunk; None: the tiny fixture's random one

# %%
# the parameters checked (-p strings parsed, ranges, no unknown -p name): a bad one stops here
from mtplib.records.parameters import checked

globals().update(checked(globals()))

# %%
from pathlib import Path

import pandas as pd

from mtplib.contract import SHARD_LOCAL, CacheKind, names_cache_state
from mtplib.model.fixture import write_fixture
from mtplib.ownership import report as rep
from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths
from mtplib.records.scratch import notebook_run
from mtplib.runtime.graph_reads import check_pair

pd.set_option("display.width", 220)
pd.set_option("display.max_columns", 30)
nb = notebook_run("02_state_contract", run_dir, trunk, sidecar)
run_dir, trunk, sidecar = nb.run_dir, nb.trunk, nb.sidecar
inv = inventory_from_paths(trunk, sidecar)
own = derive(inv, plan, CacheParams(n_ctx=ctx, n_seq=n_seq))
rep.cache_table(own)

# %% [markdown]
# ## Checked against upstream's allocation
#
# For each context below: one main decode and one MTP decode, recording every cache tensor
# the graphs touch (name, shape, type, bytes) and the size of each cache buffer
# (`ggml_backend_buffer_get_size`). The derived tensors and buffer sizes must be equal; the
# MTP context's buffer includes a V cache the graph never reads (`mtp_swa_v_unread`).

# %%
variants = [CacheParams(n_ctx=ctx, n_seq=n_seq),
            CacheParams(n_ctx=2048, n_seq=2, n_ubatch=64, swa_full=False, n_rs_seq=2),
            CacheParams(n_ctx=1024, type_k="f32")]
checks, tables = [], []
for p in variants:
    r = check_pair(inv, p)
    checks.append(r)
    label = f"n_ctx {p.n_ctx}, {p.n_seq} seq, K {p.type_k}, swa_full {p.swa_full}, rs {p.n_rs_seq}"
    tables.append(rep.caches_check_table(r).assign(params=label))
assert all(r["caches_equal"] for r in checks), [r["caches"] for r in checks]
pd.concat(tables, ignore_index=True)

# %% [markdown]
# Upstream's own log lines for the first context (sizes in MiB, cells, layers):

# %%
log = checks[0]["upstream_cache_log"]
print("\n".join(log["main"] + log["mtp"]))

# %% [markdown]
# ## DeepSeek-V4-Flash: caches per shard at 8k, 128k and 1M
#
# `swa_full=True` is llama_context_default_params' default (the raw SWA cache gets every
# cell of the context); `swa_full=False` (the common/server default) sizes it to the window
# plus one ubatch. Both are shown.

# %%
fdir = Path(flash_dir) if flash_dir else Path(run_dir) / "models" / "v4-flash"
flash = write_fixture(fdir, preset="v4-flash")
limit_s = 5  # the acceptance criterion: headers + derivations in under 5 s
owns, secs = rep.flash_ownerships(str(flash.trunk), str(flash.sidecar), shards=flash_shards,
                                  ctxs=flash_ctxs, swa_full=[True, False])
print(f"read 2 headers + {len(owns)} derivations: {secs:.3f} s")
assert secs < limit_s, secs
rows = []
for (n, c, f), o in owns.items():
    for s in o.shards:
        rows.append({"shards": n, "n_ctx": c, "swa_full": f, "shard": s.index,
                     "cache GiB": round(s.caches["total"] / 2**30, 3)})
pd.DataFrame(rows).pivot_table(index=["shards", "shard"], columns=["swa_full", "n_ctx"],
                               values="cache GiB")

# %%
pd.concat([rep.cache_table(owns[(flash_shards[-1], c, f)]) for c in flash_ctxs
           for f in (True, False)], ignore_index=True)

# %% [markdown]
# Whole-model cache bytes (the sum over the shards of each plan):

# %%
totals = rep.cache_totals(owns)
totals[totals["shards"] == flash_shards[-1]]

# %%
fig = rep.stacked_bytes_chart({f"{n} shards, 128k": owns[(n, 131072, True)] for n in flash_shards},
                              "caches", title="V4-Flash cache bytes per shard (swa_full=True)")
fig = rep.stacked_bytes_chart({f"{n} shards, 1M": owns[(n, 1048576, False)] for n in flash_shards},
                              "caches", title="V4-Flash caches per shard at 1M (swa_full=False)")

# %% [markdown]
# ## Seam bytes per token (MTP contract)
#
# Per seam: the boundary hidden row (hc x n_embd), token id and position per token; a draft
# id per draft step; a verify batch plus its result. What MTP adds depends on where its block
# runs: in the client (`--mtp-placement client`, the default) the tail sends it
# `sampler_hidden`, one `mtp_hidden_remote` row per verified position; on the tail shard
# (`tail`) it reads its rows in place and no hidden row crosses for it.

# %%
rep.seam_table(owns[(flash_shards[-1], flash_ctxs[0], True)])

# %%
rep.seam_table(own)

# %% [markdown]
# Every cache kind above is shard-local in the contract and is refused at a seam:

# %%
kinds = sorted({c.kind for c in own.caches})
tbl = pd.DataFrame([{"cache kind": k, "shard-local (contract)": CacheKind(k) in SHARD_LOCAL,
                     "refused at a seam": names_cache_state(k)} for k in kinds])
assert tbl.iloc[:, 1:].all().all()
tbl

# %% [markdown]
# ## DSpark: the draft context's caches, and what crosses per placement
#
# A DSpark draft keeps one SWA K cache per stage (upstream also allocates a V it never
# reads) and no other state: shard-local like every cache. Derived from the headers
# (`mtplib.ownership.dspark.dspark_cache_tensors`) and compared, for the same contexts as
# above, with what upstream allocates for the runtime's own draft context.

# %%
from mtplib.model.dspark.fixture import write_dspark_fixture
from mtplib.ownership.dspark import derive_dspark_from_paths
from mtplib.runtime.dspark.graph_reads import check_dspark

dspark = dspark or str(write_dspark_fixture(Path(run_dir) / "models" / "dspark", seed=0))
dsp = derive_dspark_from_paths(dspark, trunk, plan)
dchecks = [check_dspark(dsp, p) for p in variants]
assert all(r["caches_equal"] for r in dchecks), [r["caches"] for r in dchecks]
pd.concat([rep.caches_check_table({"caches": [r["caches"]]}).assign(params=str(p))
           for r, p in zip(dchecks, variants, strict=True)], ignore_index=True)

# %% [markdown]
# What crosses for DSpark beyond a plain step's boundary values, at V4-Flash's sizes
# (`mtplib.contract.dspark.dspark_crossings`, the contract's minimum; options are listed
# with their bytes but not built): with the draft in the client, the committed tokens'
# features once each; on the tail shard, ids in and drafts + confidences out. Then, per
# V4-Flash plan, the target layers whose residual the tail shard does not see (their rows
# would come from the shard before).

# %%
from mtplib.model.dspark.spec import dspark_config_for
from mtplib.ownership.dspark import crossing_table, tail_features
from mtplib.ownership.plan import even_plan, parse_plan

fcfg = dspark_config_for(next(iter(owns.values())).inventory.config)
crossings = crossing_table(fcfg)
n_flash = fcfg.target_layers[-1]  # the trunk's layers (the last target is its output)
feature_plans = tail_features(fcfg, [even_plan(n_flash, n) for n in flash_shards] + [
    parse_plan(f"0-{n_flash - 2},{n_flash - 1}-{n_flash - 1}", n_flash)])
pd.DataFrame([{"placement": pl, **r} for pl, v in crossings["placements"].items()
              for r in v["rows"]])

# %%
pd.DataFrame(feature_plans)

# %% [markdown]
# ## Contract fixtures and the alpha policy
#
# The golden JSON fixtures of the contract (`python -m mtplib.contract.golden`) are written
# afresh and compared byte for byte with the committed ones; and every named shard line-up
# of the fixtures is negotiated for every recipe under the alpha policy (which must never
# route MTP) and, for contrast, the beta policy.

# %%
from mtplib.contract.capabilities import ALPHA_POLICY
from mtplib.lab.contract_checks import golden_check, policy_check

gold, policies = golden_check(golden_dir), policy_check()
assert gold["identical"], gold["differs"]
assert policies[ALPHA_POLICY.name]["routed_mtp"] == 0
print(f"golden fixtures in {gold['dir']}: {len(gold['files'])} files, differing: {gold['differs']}")
pd.DataFrame([{"policy": k, **v} for k, v in policies.items()])

# %%
# raw metrics of this notebook (the DGR-065 evidence README is generated from them)
from mtplib.records import raw_metrics as RM

record = RM.state_record(
    checks=checks, variants=variants, flash=owns, seconds=secs, limit_s=limit_s,
    flash_shards=flash_shards, flash_ctxs=flash_ctxs, golden=gold, policies=policies,
    dspark=RM.dspark_state(checks=dchecks, variants=variants, crossings=crossings,
                           feature_plans=feature_plans))
_ = RM.write_state(run_dir, record)
