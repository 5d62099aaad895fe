"""Sources of the committed notebooks (regenerate with `python tools/nbwrite.py`)."""

NB00 = [
    ("md", """
# 00 · Fixture smoke test

Generates (or takes) a tiny DeepSeek-V4 trunk and its `mtp-` sidecar, shows their
configuration, and runs a short greedy decode twice on upstream llama.cpp to show the
output is deterministic. Run by `mtplib run` with the lane's parameters.
"""),
    ("params", """
trunk = None        # path to a trunk GGUF; None: generate the built-in fixture
sidecar = None      # path to its mtp- sidecar
preset = "tiny"
seed = 0
prompt_tokens = [1, 2, 3, 4, 5, 6, 7, 8]
n_tokens = 32
threads = 2
run_dir = "."
"""),
    ("code", """
from pathlib import Path
import pandas as pd
from mtplib.model.fixture import write_fixture, sha256_file
from mtplib.model.describe import config_frame, tensor_frame
from mtplib.runtime.generate import run_greedy

if trunk is None:
    pair = write_fixture(Path(run_dir) / "models", seed=seed, preset=preset)
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
pd.DataFrame([{"file": Path(p).name, "bytes": Path(p).stat().st_size,
               "sha256": sha256_file(Path(p))[:16]} for p in (trunk, sidecar)])
"""),
    ("md", "## Configuration (read from the sidecar header)"),
    ("code", "config_frame(sidecar)"),
    ("md", "## Tensors per file"),
    ("code", """
t, s = tensor_frame(trunk), tensor_frame(sidecar)
pd.DataFrame({"file": ["trunk", "sidecar"], "tensors": [len(t), len(s)],
              "bytes": [t.bytes.sum(), s.bytes.sum()]})
"""),
    ("md", "## Greedy decode, twice"),
    ("code", """
runs = [run_greedy(trunk, prompt_tokens, n_tokens, n_threads=threads) for _ in range(2)]
assert runs[0].tokens == runs[1].tokens, "greedy decoding is not deterministic"
pd.DataFrame([{"run": i, **r.metrics, "tokens": " ".join(map(str, r.tokens[:16])) + " ..."}
              for i, r in enumerate(runs)])
"""),
]

NOTEBOOKS = {"00_fixture_smoke.ipynb": NB00}

NB03 = [
    ("md", """
# 03 · MTP correctness (DGR-066 part 1)

The MTP runtime against its contract on the lane's trunk and `mtp-` sidecar:
MTP-on vs MTP-off output (with the near-tie audit), forced accept / reject accounting,
rollback exactness (tail removal and checkpoint restore + replay), interleaved sessions,
and sampling (sample-and-match). Every table comes from `mtplib.lab.correctness`.
"""),
    ("params", """
trunk = None
sidecar = None
threads = 2
run_dir = "."
seeds = 20
ks = [1, 2, 3]
n_new = 32
plans = ["0-1,2-3", "0-0,1-2,3-3"]
"""),
    ("code", """
import pandas as pd
import matplotlib.pyplot as plt
from mtplib.lab import correctness as C
from mtplib.lab.quality import NOISE_BOUND
from mtplib.records import raw_metrics as RM
assert trunk and sidecar, "run through `mtplib run` or set trunk/sidecar"
"""),
    ("md", "## MTP on vs off (greedy), per prompt seed and draft length"),
    ("code", """
eq = pd.DataFrame(C.equality(trunk, sidecar, seeds=range(seeds), ks=ks, n_new=n_new,
                             n_threads=threads))
summary = eq.groupby("k").agg(runs=("equal", "size"), equal=("equal", "sum"),
                              near_tie_divergences=("near_tie", "sum"),
                              drafted=("drafted", "sum"), accepted=("accepted", "sum"))
summary["unexplained_divergences"] = summary.runs - summary.equal - summary.near_tie_divergences
summary
"""),
    ("code", """
eq[~eq.equal]  # every divergence, with the MTP-off top-2 margin where it happened
"""),
    ("md", "## Forced accept and forced reject: exact accounting"),
    ("code", """
fo = pd.DataFrame(C.forced(trunk, ks=ks, n_new=n_new, n_threads=threads))
fo
"""),
    ("md", f"## Rollback exactness: next logits vs a fresh context (noise bound {5e-3})"),
    ("code", """
rb = pd.DataFrame(C.rollback_noise(trunk, n_threads=threads))
rb
"""),
    ("md", "## Interleaved sessions vs each alone"),
    ("code", """
se = pd.DataFrame(C.sessions(trunk, sidecar, n_threads=threads))
se
"""),
    ("md", "## Sampling: MTP-on vs MTP-off streams per seed (sample-and-match)"),
    ("code", """
sa = C.sampling_agreement(trunk, sidecar, n_threads=threads)
pd.DataFrame([sa])
"""),
    ("md", """
## Whole vs ranged (DGR-066 part 2)

The trunk's layers on loopback RPC shard processes (plan per row), the MTP sidecar on the
tail shard; bytes on every shard connection counted by relays, per token per step kind,
next to the contract's minimum per decode token. The same table goes into the run record.
"""),
    ("code", """
wr = pd.DataFrame(C.whole_vs_ranged(trunk, sidecar, plans=plans, n_threads=threads))
_ = RM.write_seam_bytes(run_dir, wr)  # the run record carries it, even if a later cell fails
wr
"""),
    ("md", """
For scale: the contract's minimum per token per seam for DeepSeek-V4-Flash at bf16 (the
hc*n_embd boundary row plus the token id), from the DGR-065 derivation.
"""),
    ("code", """
from mtplib.contract import DType, V4_FLASH_DIMS, seam_bytes_per_token
flash = seam_bytes_per_token(V4_FLASH_DIMS, DType.BF16)
pd.DataFrame([{"model": "V4-Flash", "dtype": "bf16", **{k: flash[k] for k in
               ("prefill_token", "decode_token", "verify_k1", "verify_k2", "verify_k3")}}])
"""),
    ("code", """
fig, ax = plt.subplots(figsize=(7, 3))
cols = [c for c in wr.columns if c.startswith("bytes_per_token_")]
wr.set_index(wr.plan + " k=" + wr.k.astype(str))[cols].plot.bar(ax=ax, logy=True)
ax.axhline(wr.contract_min_decode.iloc[0], color="k", ls="--", label="contract min / decode token")
ax.set_ylabel("bytes per token"); ax.legend(fontsize=7); plt.tight_layout()
"""),
    ("code", """
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(rb.index, rb.max_abs_dlogit, color=["C0" if n else "C1" for n in rb.n_rs_seq])
ax.axhline(NOISE_BOUND, color="k", ls="--", label="noise bound")
ax.set_xlabel("scenario (blue: tail removal, orange: checkpoint + replay)")
ax.set_ylabel("max |Δ logit|"); ax.legend(); plt.tight_layout()
"""),
    ("code", """
# raw metrics of this notebook: every table above
_ = RM.write_correctness(run_dir, RM.correctness_record(
    equality=eq, forced=fo, rollback=rb, sessions=se, sampling=sa, whole_vs_ranged=wr))
"""),
]

NOTEBOOKS["03_correctness.ipynb"] = NB03

NB01 = [
    ("md", """
# 01 · Tensor ownership (DGR-065)

Every tensor of a DeepSeek-V4 trunk and its `mtp-` sidecar gets a role (head, main_layer,
tail, mtp), the graphs that read it (main, mtp, both or none) and a shard under a plan of
contiguous layer ranges: derived from the GGUF headers alone (`mtplib.ownership.derivation`), then
**checked against the graphs upstream builds**: one main decode and one MTP decode with
the context's eval callback record every weight tensor read, and any difference stops the
notebook. The same derivation then runs on the weight-less DeepSeek-V4-Flash table (real
tensor table and dtypes, no weights) for 2, 4 and 8 shards.
"""),
    ("params", """
trunk = None          # trunk GGUF; None: generate the built-in tiny fixture
sidecar = None        # its mtp- sidecar
threads = 2
run_dir = "."
plan = "0-1,2-3"      # shard plan for the fixture (contiguous layer ranges)
ctx = 4096            # context (llama n_ctx) for the cache columns
flash_dir = None      # where to write the weight-less V4-Flash table; None: run_dir/models/v4-flash
flash_shards = [2, 4, 8]
flash_ctx = 131072    # context for the V4-Flash cache column
"""),
    ("code", """
from pathlib import Path
import pandas as pd
from mtplib.model.fixture import write_fixture, write_combined
from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths
from mtplib.ownership import report as rep
from mtplib.runtime.graph_reads import check_pair, table_check

pd.set_option("display.width", 220)
pd.set_option("display.max_columns", 30)
if trunk is None:
    pair = write_fixture(Path(run_dir) / "models", seed=0)
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
inv = inventory_from_paths(trunk, sidecar)
own = derive(inv, plan, CacheParams(n_ctx=ctx))
cfg = inv.config
print(f"{inv.layout}: {cfg.n_layer} trunk layers + {cfg.n_mtp} MTP block, plan {own.plan}")
rep.role_table(own)
"""),
    ("md", "Shipped but read by no graph (reported, not hidden):"),
    ("code", "rep.unread_table(own)"),
    ("md", """
## Checked against upstream: the weights each graph reads

`check_pair` runs one main decode on the trunk and one MTP decode on the sidecar, each with
`cb_eval` watching every graph node and its sources, and compares the weights seen with the
derived `read_by` of each file's tensors. Then the same for one file holding trunk and MTP
(upstream's single-file layout, loaded with `load_mtp`).
"""),
    ("code", """
check = check_pair(inv, CacheParams(n_ctx=ctx))
combined_path = write_combined(trunk, sidecar, Path(run_dir) / "models" / "combined")
combined = inventory_from_paths(combined_path)
check_c = check_pair(combined, CacheParams(n_ctx=ctx))
assert check["reads_equal"] and check_c["reads_equal"], (check["reads"], check_c["reads"])
pd.concat([rep.reads_check_table(check).assign(layout="pair"),
           rep.reads_check_table(check_c).assign(layout="combined")], ignore_index=True)
"""),
    ("code", "rep.role_table(combined)"),
    ("md", "## Shards of the fixture"),
    ("code", "rep.shard_table(own)"),
    ("code", "rep.replica_table(own)"),
    ("code", """
fig = rep.stacked_bytes_chart({f"fixture, plan {own.plan}": own}, "roles", unit=2**20)
fig.axes[0].set_ylabel("MiB");
"""),
    ("md", """
## DeepSeek-V4-Flash: the real tensor table, weight-less

`mtplib fixture --preset v4-flash` writes the trunk and sidecar tables of the published
config with the dtypes upstream's converter writes (MXFP4 experts, Q8_0 for the FP8
weights, BF16, F32, I32 hash tables); the data region is a sparse hole, so 150 GB of
tensors take a few MB of disk. Headers are read in milliseconds, nothing else.
"""),
    ("code", """
fdir = Path(flash_dir) if flash_dir else Path(run_dir) / "models" / "v4-flash"
flash = write_fixture(fdir, preset="v4-flash")
s = flash.summary()
pd.DataFrame([{"file": Path(s[k]["path"]).name, "logical bytes": s[k]["bytes"],
               "disk bytes": s[k]["disk_bytes"], "sha256 (header)": s[k]["sha256_header"][:16]}
              for k in ("trunk", "sidecar")])
"""),
    ("code", """
limit_s = 5  # the acceptance criterion: headers + derivations in under 5 s
owns, secs = rep.flash_ownerships(str(flash.trunk), str(flash.sidecar), shards=flash_shards,
                                  ctxs=[flash_ctx], swa_full=[True])
print(f"read 2 headers + {len(owns)} derivations: {secs:.3f} s")
assert secs < limit_s, secs
finv = next(iter(owns.values())).inventory
rep.role_table(finv)
"""),
    ("md", """
Upstream's own loader accepts the table: each file is loaded with `no_alloc` (metadata
only, no weight read, nothing allocated; in a child process) and the model size it
computes is compared with the inventory's bytes.
"""),
    ("code", """
tc = pd.DataFrame(table_check(finv))
assert tc["equal"].all(), tc
tc
"""),
    ("code", """
shards = pd.concat([rep.shard_table(owns[(n, flash_ctx, True)]) for n in flash_shards],
                   ignore_index=True)
mtp_block = owns[(flash_shards[0], flash_ctx, True)].mtp_block_bytes
print(f"MTP block (blk.43.*): {mtp_block} bytes = {mtp_block / 2**30:.3f} GiB")
shards
"""),
    ("code", "rep.replica_table(owns[(flash_shards[-1], flash_ctx, True)])"),
    ("md", """
Equal layer counts leave the last shard heaviest (tail + MTP sidecar). A byte-balanced
plan (contiguous ranges minimising the largest shard, `ownership.balanced_plan`):
"""),
    ("code", """
from mtplib.ownership.derivation import balanced_plan
from mtplib.ownership.plan import even_plan
plans = pd.DataFrame([{"shards": n, "plan": kind, "ranges": str(p),
               "largest shard GiB": round(max(s.bytes for s in derive(finv, p).shards) / 2**30, 3)}
              for n in flash_shards
              for kind, p in (("even", even_plan(43, n)), ("balanced", balanced_plan(finv, n)))])
plans
"""),
    ("code", """
fig = rep.stacked_bytes_chart({f"{n} shards": owns[(n, flash_ctx, True)] for n in flash_shards},
                              "roles", title="DeepSeek-V4-Flash: bytes held per shard, by role")
"""),
    ("code", """
# raw metrics of this notebook (the DGR-065 evidence README is generated from them)
from mtplib.records import raw_metrics as RM
record = RM.ownership_record(
    fixture=own, combined=combined, ctx=ctx, reads={"pair": check, "combined": check_c},
    flash=owns, flash_files=flash.summary(), flash_ctx=flash_ctx, flash_shards=flash_shards,
    seconds=secs, limit_s=limit_s, table_check=tc, plans=plans)
_ = RM.write_ownership(run_dir, record)
"""),
]

NOTEBOOKS["01_tensor_ownership.ipynb"] = NB01

NB02 = [
    ("md", """
# 02 · State contract: caches per shard (DGR-065)

Which caches each shard allocates for a context (raw SWA K, CSA/HCA compressed K, indexer
K, compressor states, the MTP block's K), with their bytes: derived from the headers and
the context parameters (`mtplib.ownership.derivation.cache_tensors`), then **compared with what
upstream allocates** for the same context on the fixture (every cache tensor the graphs
touch, and the exact size of every cache buffer). Then the same derivation for
DeepSeek-V4-Flash at 8k, 128k and 1M context over 2, 4 and 8 shards, and the seam bytes
per token of the MTP contract. All caches are shard-local: none crosses a seam.
"""),
    ("params", """
trunk = None
sidecar = None
threads = 2
run_dir = "."
plan = "0-1,2-3"
ctx = 4096
n_seq = 1
flash_dir = None
flash_shards = [2, 4, 8]
flash_ctxs = [8192, 131072, 1048576]
golden_dir = None     # contract golden fixtures; None: the repo's tests/golden/contract
"""),
    ("code", """
from pathlib import Path
import pandas as pd
from mtplib.contract import SHARD_LOCAL, CacheKind, names_cache_state
from mtplib.model.fixture import write_fixture
from mtplib.ownership.derivation import CacheParams, derive, inventory_from_paths
from mtplib.ownership import report as rep
from mtplib.runtime.graph_reads import check_pair

pd.set_option("display.width", 220)
pd.set_option("display.max_columns", 30)
if trunk is None:
    pair = write_fixture(Path(run_dir) / "models", seed=0)
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
inv = inventory_from_paths(trunk, sidecar)
own = derive(inv, plan, CacheParams(n_ctx=ctx, n_seq=n_seq))
rep.cache_table(own)
"""),
    ("md", """
## Checked against upstream's allocation

For each context below: one main decode and one MTP decode, recording every cache tensor
the graphs touch (name, shape, type, bytes) and the size of each cache buffer
(`ggml_backend_buffer_get_size`). The derived tensors and buffer sizes must be equal; the
MTP context's buffer includes a V cache the graph never reads (`mtp_swa_v_unread`).
"""),
    ("code", """
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
"""),
    ("md", "Upstream's own log lines for the first context (sizes in MiB, cells, layers):"),
    ("code", """
log = checks[0]["upstream_cache_log"]
print("\\n".join(log["main"] + log["mtp"]))
"""),
    ("md", """
## DeepSeek-V4-Flash: caches per shard at 8k, 128k and 1M

`swa_full=True` is llama_context_default_params' default (the raw SWA cache gets every
cell of the context); `swa_full=False` (the common/server default) sizes it to the window
plus one ubatch. Both are shown.
"""),
    ("code", """
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
"""),
    ("code", """
pd.concat([rep.cache_table(owns[(flash_shards[-1], c, f)]) for c in flash_ctxs
           for f in (True, False)], ignore_index=True)
"""),
    ("md", "Whole-model cache bytes (the sum over the shards of each plan):"),
    ("code", """
totals = rep.cache_totals(owns)
totals[totals["shards"] == flash_shards[-1]]
"""),
    ("code", """
fig = rep.stacked_bytes_chart({f"{n} shards, 128k": owns[(n, 131072, True)] for n in flash_shards},
                              "caches", title="V4-Flash cache bytes per shard (swa_full=True)")
fig = rep.stacked_bytes_chart({f"{n} shards, 1M": owns[(n, 1048576, False)] for n in flash_shards},
                              "caches", title="V4-Flash caches per shard at 1M (swa_full=False)")
"""),
    ("md", """
## Seam bytes per token (MTP contract)

Per seam: the boundary hidden row (hc x n_embd), token id and position per token; a draft
id per draft step; a verify batch plus its result. MTP runs on the tail shard, so no MTP
hidden row crosses a seam (`mtp_hidden_remote` is what it would cost otherwise).
"""),
    ("code", "rep.seam_table(owns[(flash_shards[-1], flash_ctxs[0], True)])"),
    ("code", "rep.seam_table(own)"),
    ("md", "Every cache kind above is shard-local in the contract and is refused at a seam:"),
    ("code", """
kinds = sorted({c.kind for c in own.caches})
tbl = pd.DataFrame([{"cache kind": k, "shard-local (contract)": CacheKind(k) in SHARD_LOCAL,
                     "refused at a seam": names_cache_state(k)} for k in kinds])
assert tbl.iloc[:, 1:].all().all()
tbl
"""),
    ("md", """
## Contract fixtures and the alpha policy

The golden JSON fixtures of the contract (`python -m mtplib.contract.golden`) are written
afresh and compared byte for byte with the committed ones; and every named shard line-up
of the fixtures is negotiated for every recipe under the alpha policy (which must never
route MTP) and, for contrast, the beta policy.
"""),
    ("code", """
from mtplib.contract.capabilities import ALPHA_POLICY
from mtplib.lab.contract_checks import golden_check, policy_check

gold, policies = golden_check(golden_dir), policy_check()
assert gold["identical"], gold["differs"]
assert policies[ALPHA_POLICY.name]["routed_mtp"] == 0
print(f"golden fixtures in {gold['dir']}: {len(gold['files'])} files, differing: {gold['differs']}")
pd.DataFrame([{"policy": k, **v} for k, v in policies.items()])
"""),
    ("code", """
# raw metrics of this notebook (the DGR-065 evidence README is generated from them)
from mtplib.records import raw_metrics as RM
record = RM.state_record(
    checks=checks, variants=variants, flash=owns, seconds=secs, limit_s=limit_s,
    flash_shards=flash_shards, flash_ctxs=flash_ctxs, golden=gold, policies=policies)
_ = RM.write_state(run_dir, record)
"""),
]

NOTEBOOKS["02_state_contract.ipynb"] = NB02

NB04 = [
    ("md", """
# 04 · MTP off vs on benchmark (DGR-066 part 3)

For the lane's trunk and `mtp-` sidecar: MTP off and MTP on (k = 1..3) per plan, with
warm-up runs excluded and repetitions for the spread; quality against MTP off; acceptance
overall, per draft position and as a histogram; TTFT and decode speed; the time split;
memory; seam bytes. Then the synthetic acceptance sweep: the target's own continuation,
cut at a length drawn with upstream's `--spec-synth-rates` semantics, gives the speed-up
at acceptance 0..100% and the break-even acceptance, with the reference numbers of
upstream-v4-mtp.md §9 marked.
Everything comes from `mtplib.lab.bench`; raw rows go to `run_dir/bench/` (JSON + CSV).
"""),
    ("params", """
trunk = None
sidecar = None
threads = 2
run_dir = "."
bench = {}          # the lane's `bench:` section (mtplib.lab.bench.BenchConfig)
sbs_dir = "evidence/side-by-side"   # committed side-by-side results (repo-relative)
"""),
    ("code", """
import pandas as pd
from IPython.display import Image, Markdown, display
from mtplib.lab import bench as B
from mtplib.records import raw_metrics as RM
assert trunk and sidecar, "run through `mtplib run` or set trunk/sidecar"
cfg = B.BenchConfig.from_dict(bench, threads=threads)
result = B.run_bench(trunk, sidecar, cfg)
paths = RM.write_bench(run_dir, result)
data = RM.read_bench(run_dir)
summ = pd.DataFrame(data["summary"])
def plot(name):  # the PNG saved with the raw metrics (bench/plots/), as the evidence shows it
    display(Image(filename=str(paths[f"plot_{name}"])))
pd.DataFrame([{"bench wall s": round(data["wall_s"], 1), **{k: v for k, v in
              data["config"].items() if k not in ("sweep", "sampling")}}])
"""),
    ("md", "## Speed: MTP off vs on (median over repetitions, warm-up excluded)"),
    ("code", """
summ[["plan", "k", "runs", "decode_tok_s_median", "decode_tok_s_min", "decode_tok_s_max",
      "decode_tok_s_spread_pct", "speedup", "ttft_ms_median"]]
"""),
    ("code", "plot('speed_vs_k')"),
    ("md", "## Acceptance: overall, per draft position, accepted-length histogram"),
    ("code", """
acc = summ[summ.k > 0][["plan", "k", "drafted", "accepted", "acceptance", "acceptance_pos_1",
                        "acceptance_pos_2", "acceptance_pos_3", "mean_accept_len"]]
hist = pd.DataFrame([{"k": r["k"], **{f"{a} accepted": n for a, n in
                                      r["accept_len_hist"].items()}}
                     for r in data["summary"] if r["k"] > 0]).set_index("k")
display(acc, hist)
"""),
    ("code", "plot('acceptance_per_position')"),
    ("md", "## Quality against MTP off (greedy with near-tie allowance; sampling)"),
    ("code", """
qcols = ["plan", "k", "runs", "equal_to_off_runs", "token_agreement_pct",
         "near_tie_divergences", "unexplained_divergences"]
qcols += [c for c in ("sampling_equal_streams", "sampling_streams", "sampling_tv_distance")
          if c in summ]
summ[summ.k > 0][qcols]
"""),
    ("md", "## Where the time goes (ms per generated token)"),
    ("code", """
parts = ["prefill", "draft", "verify", "feed", "rollback"]
summ[["plan", "k"] + [f"ms_per_token_{p}" for p in parts] + [f"share_{p}_pct" for p in parts]]
"""),
    ("code", "plot('time_split')"),
    ("md", "## Memory and seam bytes"),
    ("code", """
summ[["plan", "k", "rss_peak_mib", "trunk_weights_mib", "mtp_weights_mib",
      "target_seq_state_kib", "mtp_seq_state_kib", "seam_bytes_per_token"]]
"""),
    ("code", "plot('seam_bytes')"),
    ("md", """
## Acceptance sweep: speed-up vs acceptance, break-even

Synthetic drafts (only speed is valid here). The x axis is the measured acceptance at
draft position 1; diamonds mark where this lane's own MTP sits.
"""),
    ("code", """
sw = pd.DataFrame(data["sweep"])
display(sw[["k", "rate", "acceptance_pos_1", "acceptance", "decode_tok_s_median", "speedup",
            "reference_intact_runs", "runs"]] if len(sw) else "sweep off",
        pd.DataFrame(data["break_even"]))
"""),
    ("code", "plot('speedup_curve')"),
    ("md", "Reference numbers (upstream-v4-mtp.md §9), not measured here:"),
    ("code", """
pd.DataFrame([{"reference": k, **v} for k, v in data["reference_s9"].items()])
"""),
]

NB04 += [
    ("md", """
## Real acceptance: the trained tiny V4 (issue 9) next to the anchors

Random-weight fixtures accept about 1/vocab. The committed trained pair
(`evidence/trained-v4/`, MTP head trained jointly with DeepSeek's objective) gives real
acceptance per position on held-out text, measured by `python -m mtplib.lab.trained_eval`
(greedy, 32 held-out prompts x 128 tokens, 1 thread); the reference anchors are from
reference §9 (DeepSeek-V3: 85-90% second-token acceptance, the midpoint shown; vLLM V4).
At this size MTP on is slower than off (speed-up < 1): a verify step costs more than the
tokens it saves. Read these acceptances against the sweep's speed-up curve above.
"""),
    ("code", """
from mtplib.lab.trained_eval import anchor_table
pd.DataFrame(anchor_table())
"""),
]

NB04 += [
    ("md", """
## Side by side with upstream's C++ MTP loop (issue 7, preset `v4-ratio-cpu`)

Committed results from `mtplib compare-upstream` (opt-in, not part of CI; commands in each
file's `argv` and in `evidence/side-by-side/README.md`). Upstream side: `llama-server`
built from the pinned sdist, `--spec-type draft-mtp -md SIDECAR --spec-draft-n-max k
[--spec-synth-rates ...]`, the prompt sent as token ids. mtplib side: `MTPRuntime`, same
files, threads, context, batch, KV type, k, rates and seed. Each case: a warm-up per side,
then interleaved A/B runs; decode tok/s medians; ratio = mtplib / upstream (goal >= 0.9).
The machine has 2 shared vCPUs, so the 1-minute load average is shown next to every case.
"""),
    ("code", """
from mtplib.lab import sidebyside as SBS
sbs = SBS.evidence_dir(sbs_dir)
if not sbs.is_dir():
    print(f"no side-by-side results in {sbs}")
for p in sorted(sbs.glob("sbs-*.json")):
    display(Markdown(f"**{p.name}**"), SBS.table(p))
"""),
    ("md", "Plain decoding repeated (the case whose ratio moves most with the load):"),
    ("code", """
reps = sorted(sbs.glob("plain-repeat-*.json"))
pd.concat([SBS.table(p).assign(file=p.name) for p in reps]) if reps else "none"
"""),
    ("md", """
### The preset's cost ratio: one MTP step against one trunk step

Median one-token `llama_decode` time of the MTP context over the trunk's, 300 tokens,
interleaved token by token (`compare-upstream --cost-ratio-only`). DeepSeek-V4-Flash's
MTP block is about 1/43 of its active compute; the `tiny` fixture's is about 1/5.
"""),
    ("code", "SBS.cost_ratio_table(sorted(sbs.glob('cost-ratio-*.json')))"),
    ("md", """
### Acceptance -> speed on `v4-ratio-cpu`, break-even acceptance

The MTP block drafts every step (its real cost); acceptance is synthetic with upstream's
`--spec-synth-rates` semantics at the same rate at every position; MTP-off runs are
interleaved with every k. Break-even = where the speed-up crosses 1.
"""),
    ("code", """
import matplotlib.pyplot as plt
sweeps = sorted(sbs.glob("sweep-*.json"))
for p in sweeps:
    sw, be = SBS.sweep_table(p)
    display(Markdown(f"**{p.name}**"), sw, be)
if sweeps:
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6.5 * len(sweeps), 4), squeeze=False)
    for p, ax in zip(sweeps, axes[0]):
        SBS.plot_sweep(p, ax=ax)
    plt.show()
"""),
]

NOTEBOOKS["04_benchmark.ipynb"] = NB04

NB05 = [
    ("md", """
# 05 · Ranged MTP over a WAN (issue 14)

The trained tiny V4 pair split over local RPC shards, each behind a relay that emulates a
WAN link (half the round trip each way, chunks pipelined). For every plan, topology
(`remote`: every shard behind the WAN; `tail_local`: the tail shard co-located with the
client) and drafter placement (MTP on the `tail` shard or in the `client`), tokens/s against
RTT for MTP off and k = 1..3, with the waits (synchronous round trips) per step kind, bytes
by class, and the cache bytes that crossed a shard connection (the contract says 0).

It runs once per upstream build: `stock` and `patched` (patches/*.patch: the V4
compressor-state restore pinned to its layer's shard), each in its own process.
"""),
    ("params", """
run_dir = ""  # where results go; empty: a scratch folder under outputs/
wan = {}  # mtplib.lab.wan.WanConfig fields; empty: the defaults (a full sweep)
builds = ["stock", "patched"]
overrides = {}  # build -> WanConfig fields for that build only (e.g. a smaller stock grid)
threads = 1
"""),
    ("code", """
from pathlib import Path

import pandas as pd
from IPython.display import display

from mtplib import paths
from mtplib.lab import wan as W

pd.set_option("display.width", 200)
pd.set_option("display.precision", 3)
out = Path(run_dir) if run_dir else paths.OUTPUTS / "scratch-05_wan"
cfg = W.WanConfig.from_dict(wan)
cfg
"""),
    ("code", """
results = W.run_builds(cfg, out / "wan", builds=builds, overrides=overrides, log=print)
list(results)
"""),
    ("md", """
## Tokens/s and speed-up against RTT
One line per topology, placement and draft length; `MTP off` is the same connections
without drafting. The speed-up a WAN-bound loop approaches is the tokens per verify step.
"""),
    ("code", """
import matplotlib.pyplot as plt

for build, d in results.items():
    for plan in sorted({s["plan"] for s in d["summary"]}):
        fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
        W.plot_rtt(d["summary"], what="tok_s", plan=plan, ax=axes[0])
        W.plot_rtt(d["summary"], what="speedup", plan=plan, ax=axes[1])
        fig.suptitle(f"upstream build: {build}")
        fig.tight_layout()
        plt.show()
"""),
    ("md", """
## The targets at 100 ms (plan 0-1,2-3, k=2)
`ratio` = speed-up over MTP off / tokens per verify step (goal >= 0.85 with the tail
co-located, >= 0.70 with every shard remote and the drafter in the client);
`extra waits/verify` = waits of a verify step minus those of a plain step.
"""),
    ("code", """
for build, d in results.items():
    print(build)
    display(pd.DataFrame(d["targets"]))
"""),
    ("md", """
## Waits per step kind and bytes per step by class
"""),
    ("code", """
for build, d in results.items():
    s = pd.DataFrame(d["summary"])
    top = s[s.rtt_ms == s.rtt_ms.max()]
    print(build)
    display(top[["plan", "topology", "placement", "k", "tok_s", "speedup", "tokens_per_step",
                 "waits_per_plain", "waits_per_verify", "waits_per_draft", "waits_per_token",
                 "cache_bytes_crossing", "identical_to_off"]])
    b = pd.DataFrame(d["bytes_by_class"])
    display(b[b.step.isin(["decode", "verify", "draft", "feed", "rollback"])].round(0))
"""),
    ("md", """
## The cost model
`s/token = compute + RTT x waits`, fitted per configuration on the lower RTTs and checked
on the others; the fitted waits sit next to the measured ones.
"""),
    ("code", """
for build, d in results.items():
    print(build)
    display(pd.DataFrame(d["cost_model"]))
"""),
]

NOTEBOOKS["05_wan.ipynb"] = NB05
