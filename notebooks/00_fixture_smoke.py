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
# # 00 · Fixture smoke test
#
# Generates (or takes) a tiny DeepSeek-V4 trunk and its `mtp-` sidecar, shows their
# configuration, and runs a short greedy decode twice on upstream llama.cpp to show the
# output is deterministic. Run by `mtplib run` with the lane's parameters; opened on its own
# it writes into a scratch run folder under `outputs/scratch/` (printed below).

# %% tags=["parameters"]
from typing import Optional

trunk: Optional[str] = None  # trunk GGUF; None: generate the built-in fixture
sidecar: Optional[str] = None  # path to its mtp- sidecar (set both or neither)
preset: str = "tiny"  # fixture preset when generating (mtplib fixture --preset)
seed: int = 0  # fixture seed when generating
prompt_tokens: list[int] = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids of the prompt
n_tokens: int = 32  # tokens to generate per run
threads: int = 2  # CPU threads
run_dir: Optional[str] = None  # None: a new scratch folder in outputs/scratch/

# %%
# the parameters checked (-p strings parsed, ranges, no unknown -p name): a bad one stops here
from mtplib.records.parameters import checked

globals().update(checked(globals()))

# %%
from pathlib import Path

import pandas as pd

from mtplib.model.describe import config_frame, tensor_frame
from mtplib.model.fixture import sha256_file
from mtplib.records.scratch import notebook_run
from mtplib.runtime.generate import run_greedy

nb = notebook_run("00_fixture_smoke", run_dir, trunk, sidecar, preset=preset, seed=seed)
run_dir, trunk, sidecar = nb.run_dir, nb.trunk, nb.sidecar
pd.DataFrame([{"file": Path(p).name, "bytes": Path(p).stat().st_size,
               "sha256": sha256_file(Path(p))[:16]} for p in (trunk, sidecar)])

# %% [markdown]
# ## Configuration (read from the sidecar header)

# %%
config_frame(sidecar)

# %% [markdown]
# ## Tensors per file

# %%
t, s = tensor_frame(trunk), tensor_frame(sidecar)
pd.DataFrame({"file": ["trunk", "sidecar"], "tensors": [len(t), len(s)],
              "bytes": [t.bytes.sum(), s.bytes.sum()]})

# %% [markdown]
# Where the bytes sit: per transformer block (`blk.N`), and outside any block (embedding,
# output head, final norms). The sidecar holds the MTP block and its own head.

# %%
import matplotlib.pyplot as plt


def per_block(frame: pd.DataFrame) -> pd.Series:
    part = frame.block.map(lambda b: "outside blocks" if pd.isna(b) else f"blk.{int(b)}")
    return frame.groupby(part).bytes.sum() / 2**10


fig, ax = plt.subplots(figsize=(7, 3))
pd.DataFrame({"trunk": per_block(t), "sidecar": per_block(s)}).fillna(0).plot.bar(ax=ax, rot=0)
ax.set_title(f"Tensor bytes per block ({Path(trunk).name} + {Path(sidecar).name})")
ax.set_xlabel("tensor group")
ax.set_ylabel("size (KiB)")
plt.tight_layout()

# %% [markdown]
# ## Greedy decode, twice

# %%
from mtplib.lab.common.display import show

runs = [run_greedy(trunk, prompt_tokens, n_tokens, n_threads=threads) for _ in range(2)]
assert runs[0].tokens == runs[1].tokens, "greedy decoding is not deterministic"
show([{"run": i, **r.summary(), "tokens": " ".join(map(str, r.tokens[:16])) + " ..."}
      for i, r in enumerate(runs)])
