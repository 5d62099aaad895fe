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
# output is deterministic. Run by `mtplib run` with the lane's parameters.

# %% tags=["parameters"]
trunk = None        # path to a trunk GGUF; None: generate the built-in fixture
sidecar = None      # path to its mtp- sidecar
preset = "tiny"
seed = 0
prompt_tokens = [1, 2, 3, 4, 5, 6, 7, 8]
n_tokens = 32
threads = 2
run_dir = "."

# %%
from pathlib import Path

import pandas as pd

from mtplib.model.describe import config_frame, tensor_frame
from mtplib.model.fixture import sha256_file, write_fixture
from mtplib.runtime.generate import run_greedy

if trunk is None:
    pair = write_fixture(Path(run_dir) / "models", seed=seed, preset=preset)
    trunk, sidecar = str(pair.trunk), str(pair.sidecar)
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
# ## Greedy decode, twice

# %%
from mtplib.lab.display import show

runs = [run_greedy(trunk, prompt_tokens, n_tokens, n_threads=threads) for _ in range(2)]
assert runs[0].tokens == runs[1].tokens, "greedy decoding is not deterministic"
show([{"run": i, **r.metrics, "tokens": " ".join(map(str, r.tokens[:16])) + " ..."}
      for i, r in enumerate(runs)])
