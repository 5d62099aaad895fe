"""The PyTorch V4 implementation (mtplib.train) against upstream, and training mechanics.

Needs the optional extra `train` (torch, tokenizers): skipped without it (CI has neither).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from mtplib.train import data  # noqa: E402
from mtplib.train.model import heap_select  # noqa: E402


def test_heap_select_is_top_k_without_ties():
    rng = random.Random(0)
    for _ in range(50):
        v = [rng.random() for _ in range(rng.randint(1, 300))]
        k = rng.randint(1, len(v))
        want = set(sorted(range(len(v)), key=lambda i: -v[i])[:k])
        assert set(heap_select(v, k)) == want


def test_heap_select_tie_order_is_not_lowest_index():
    # 64 tied zeros fill the heap; each later 1 evicts the heap top, whichever zero that is
    v = [0.0] * 64 + [1.0] * 10
    sel = set(heap_select(v, 64))
    assert set(range(64, 74)) <= sel
    assert sel != set(range(54)) | set(range(64, 74))


CPP = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int n, k;
    while (std::scanf("%d %d", &n, &k) == 2) {
        std::vector<float> v(n);
        for (auto & x : v) std::scanf("%f", &x);
        std::vector<int> idx(n);
        for (int i = 0; i < n; i++) idx[i] = i;
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                          [&](int a, int b) { return v[a] > v[b]; });
        for (int i = 0; i < k; i++) std::printf("%d ", idx[i]);
        std::printf("\n");
    }
}
"""


def test_heap_select_matches_libstdcxx_partial_sort(tmp_path):
    import shutil
    import subprocess

    if not shutil.which("g++"):
        pytest.skip("no g++ to build the libstdc++ reference")
    (tmp_path / "ps.cpp").write_text(CPP)
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "ps"), str(tmp_path / "ps.cpp")],
                   check=True)
    rng = random.Random(1)
    cases, lines = [], []
    for _ in range(40):  # tie-heavy rows: few distinct values, -inf padding
        n = rng.choice([256, 300, 512])
        v = [float(rng.choice([0, 0, 0, 1, 2, -1])) for _ in range(n - 40)] + [-1e30] * 40
        k = rng.randint(1, n)
        cases.append((v, k))
        lines.append(f"{n} {k} " + " ".join(f"{x:g}" for x in v))
    out = subprocess.run([str(tmp_path / "ps")], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    for (v, k), line in zip(cases, out, strict=True):
        assert sorted(heap_select(v, k)) == sorted(int(x) for x in line.split())


@pytest.mark.slow
def test_torch_model_matches_upstream_on_random_fixture(pair):
    """Every layer kind of the tiny preset (hash, SWA, CSA with the indexer's top-k and its
    ties active at 300 tokens, HCA) and the MTP graph: max |Δlogit| far below 1e-3."""
    from mtplib.train.parity import compare

    toks = np.random.default_rng(0).integers(0, pair.config.n_vocab, 300).tolist()
    r = compare(pair.trunk, pair.sidecar, toks)
    assert r["trunk_max_abs"] < 1e-4, r
    assert r["mtp_max_abs_upstream_rows"] < 1e-4, r
    assert r["mtp_max_abs_torch_rows"] < 1e-4, r
    assert r["rows_max_abs"] < 1e-4, r


def test_split_is_deterministic_and_disjoint():
    a, b = data.make_split(), data.make_split()
    assert a == b
    assert not set(a.train) & set(a.heldout)
    assert 0.05 < len(a.heldout) / (len(a.train) + len(a.heldout)) < 0.2
    assert all(data.is_heldout(n) for n in a.heldout)


def test_batches_depend_only_on_seed_and_step():
    s = np.arange(10_000, dtype=np.int32)
    assert np.array_equal(data.batch(s, 7, 1, 4, 33), data.batch(s, 7, 1, 4, 33))
    assert not np.array_equal(data.batch(s, 7, 1, 4, 33), data.batch(s, 8, 1, 4, 33))


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_run(tmp_path):
    from mtplib.train.config import TrainConfig
    from mtplib.train.train import train

    tc = TrainConfig(steps=3, batch_size=2, seq_len=32, eval_every=2, ckpt_every=2,
                     eval_batches=1)
    kw = dict(minutes=10, seed=3, tc=tc, threads=1, compile_model=False)
    full = train(tmp_path / "full", resume=False, **kw)
    part = tmp_path / "part"
    part.mkdir()
    (part / "tokenizer.json").write_bytes((tmp_path / "full" / "tokenizer.json").read_bytes())
    first = train(part, resume=False, stop_after=2, **kw)
    assert first["step"] == 2 and first["stopped"] == "stop_after 2"
    res = train(part, resume=True, **kw)
    assert res["step"] == 3
    a, b = full["model"].state_dict(), res["model"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    hist = [json.loads(x) for x in (part / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist if h["kind"] == "train"] == [1, 2, 3]
