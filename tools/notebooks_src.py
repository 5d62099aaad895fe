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
from mtplib.fixture import write_fixture, sha256_file
from mtplib.describe import config_frame, tensor_frame
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
and sampling (sample-and-match). Every table comes from `mtplib.correctness`.
"""),
    ("params", """
trunk = None
sidecar = None
threads = 2
run_dir = "."
seeds = 20
ks = [1, 2, 3]
n_new = 32
"""),
    ("code", """
import json
from pathlib import Path
import pandas as pd
import matplotlib.pyplot as plt
from mtplib import correctness as C
from mtplib.quality import NOISE_BOUND
assert trunk and sidecar, "run through `mtplib run` or set trunk/sidecar"
results = {}
"""),
    ("md", "## MTP on vs off (greedy), per prompt seed and draft length"),
    ("code", """
eq = pd.DataFrame(C.equality(trunk, sidecar, seeds=range(seeds), ks=ks, n_new=n_new,
                             n_threads=threads))
results["equality"] = eq.to_dict("records")
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
results["forced"] = fo.to_dict("records")
fo
"""),
    ("md", f"## Rollback exactness: next logits vs a fresh context (noise bound {5e-3})"),
    ("code", """
rb = pd.DataFrame(C.rollback_noise(trunk, n_threads=threads))
results["rollback"] = rb.to_dict("records")
rb
"""),
    ("md", "## Interleaved sessions vs each alone"),
    ("code", """
se = pd.DataFrame(C.sessions(trunk, sidecar, n_threads=threads))
results["sessions"] = se.to_dict("records")
se
"""),
    ("md", "## Sampling: MTP-on vs MTP-off streams per seed (sample-and-match)"),
    ("code", """
sa = C.sampling_agreement(trunk, sidecar, n_threads=threads)
results["sampling"] = sa
pd.DataFrame([sa])
"""),
    ("code", """
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(rb.index, rb.max_abs_dlogit, color=["C0" if n else "C1" for n in rb.n_rs_seq])
ax.axhline(NOISE_BOUND, color="k", ls="--", label="noise bound")
ax.set_xlabel("scenario (blue: tail removal, orange: checkpoint + replay)")
ax.set_ylabel("max |Δ logit|"); ax.legend(); plt.tight_layout()
Path(run_dir, "correctness.json").write_text(json.dumps(results, indent=2, default=str))
"""),
]

NOTEBOOKS["03_correctness.ipynb"] = NB03
