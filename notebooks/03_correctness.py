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
# Opened on its own it generates the fixture into a scratch run folder under
# `outputs/scratch/`, with small defaults (a lane passes its own, larger ones).

# %% tags=["parameters"]
from typing import Optional

trunk: Optional[str] = None  # trunk GGUF; None: generate the built-in fixture
sidecar: Optional[str] = None  # its mtp- sidecar (set both or neither)
threads: int = 2  # CPU threads
run_dir: Optional[str] = None  # None: a new scratch folder in outputs/scratch/
seeds: int = 2  # prompt seeds of the equality table (the cpu-fixture lane: 20)
ks: list[int] = [1, 2, 3]  # draft lengths (-p ks 2, -p ks 1,2 or -p ks '[1, 2]')
n_new: int = 16  # tokens per generation (the cpu-fixture lane: 32)
plans: list[str] = ["0-1,2-3", "0-0,1-2,3-3"]  # ranged plans (-p plans '0-1,2-3;0-0,1-2,3-3')
sampling_seeds: int = 8  # sample-and-match seeds (the cpu-fixture lane: 100)
progress: bool = True  # tqdm progress bars in the long cells

# %%
# the parameters checked (-p strings parsed, ranges, no unknown -p name): a bad one stops here
from mtplib.records.parameters import checked

globals().update(checked(globals()))

# %%
import pandas as pd

from mtplib.lab import correctness as C
from mtplib.lab import correctness_plots as CP
from mtplib.lab.common import display as D
from mtplib.lab.quality import NOISE_BOUND
from mtplib.records import raw_metrics as RM
from mtplib.records.scratch import notebook_run

nb = notebook_run("03_correctness", run_dir, trunk, sidecar)
run_dir, trunk, sidecar = nb.run_dir, nb.trunk, nb.sidecar

# %% [markdown]
# ## MTP on vs off (greedy), per prompt seed and draft length

# %%
eq = pd.DataFrame(C.equality(trunk, sidecar, seeds=range(seeds), ks=ks, n_new=n_new,
                             n_threads=threads, progress=progress))
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
fo = pd.DataFrame(C.forced(trunk, ks=ks, n_new=n_new, n_threads=threads, progress=progress))
D.show(fo)

# %% [markdown]
# ## Rollback exactness: next logits vs a fresh context (noise bound 0.005)

# %%
rb = pd.DataFrame(C.rollback_noise(trunk, n_threads=threads, progress=progress))
D.show(rb)

# %% [markdown]
# ## Interleaved sessions vs each alone

# %%
se = pd.DataFrame(C.sessions(trunk, sidecar, n_threads=threads, progress=progress))
D.show(se)

# %% [markdown]
# ## Sampling: MTP-on vs MTP-off streams per seed (sample-and-match)

# %%
sa = C.sampling_agreement(trunk, sidecar, n_seeds=sampling_seeds, n_threads=threads,
                          progress=progress)
D.show([sa])

# %% [markdown]
# ## Whole vs ranged (DGR-066 part 2)
#
# The trunk's layers on loopback RPC shard processes (plan per row), the MTP block where the
# default placement puts it (the client; `mtp_on_tail` says whether it ran on the tail shard);
# bytes on every shard connection counted by relays, per token per step kind, next to the
# contract's minimum per decode token. The same table goes into the run record.

# %%
wr = pd.DataFrame(C.whole_vs_ranged(trunk, sidecar, plans=plans, n_threads=threads,
                                    progress=progress))
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

# %% [markdown]
# ## `mtp_llama`: the MTP block as llama-cpp-python's draft model (trained pair)
#
# `mtplib.llama.mtp_llama` returns a plain `llama_cpp.Llama` whose `draft_model` is the V4
# MTP block, so `Llama`'s own speculative loop drafts with it. On the committed trained pair
# (`evidence/trained-v4/`; random fixtures accept about 1/vocab, so they would show nothing)
# at temperature 0 each completion must equal plain `Llama`'s, with drafts accepted. This
# section uses the trained pair whatever the lane's models are; without it, it is skipped.

# %%
from IPython.display import display

from mtplib.model.fixture import trained_pair

tp = trained_pair()
if tp is None:
    print("skipped: the trained pair (evidence/trained-v4/*.gguf) is not in this checkout")
else:
    from mtplib.llama import mtp_llama, plain_llama

    kw = {"n_ctx": 512, "n_threads": threads, "n_threads_batch": threads}
    texts = ["def main(", "import os\nimport sys\n\n\nclass ", "    def __init__(self"]
    plain = plain_llama(tp.trunk, **kw)
    mtp = mtp_llama(tp.trunk, tp.sidecar, draft=3, **kw)
    st = mtp.draft_model.stats
    rows = []
    try:
        for text in texts:
            want = plain.create_completion(text, max_tokens=24, temperature=0)
            d0, a0 = st.drafted, st.accepted
            got = mtp.create_completion(text, max_tokens=24, temperature=0)
            rows.append({"prompt": text, "equal_to_plain": got["choices"][0]["text"] ==
                         want["choices"][0]["text"], "drafted": st.drafted - d0,
                         "accepted": st.accepted - a0, "completion": got["choices"][0]["text"]})
    finally:
        mtp.close()
        plain.close()
    llama_eq = pd.DataFrame(rows)
    stats = {k: v for k, v in st.to_dict().items() if k not in ("skipped", "time_s")}
    display(D.show(llama_eq), D.show(pd.DataFrame([stats])))
    assert llama_eq.equal_to_plain.all(), "mtp_llama's greedy text differs from plain Llama's"
    assert st.accepted > 0, "no draft of the trained MTP block was accepted"
