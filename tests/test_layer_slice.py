"""Issue 24: the V4-Flash-width slice preset, its dtype-faithful writer, the layer-cost
derivation, and the projection taking measured compute instead of its assumption."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mtplib.errors import InputError
from mtplib.lab import layer_cost as LC
from mtplib.lab.projection.compute import compute_model
from mtplib.lab.projection.compute_inputs import (
    ASSUMED_COMPUTE,
    LAYER_COST_SCHEMA,
    ComputeInputs,
    load_compute,
)
from mtplib.lab.projection.params import ProjectionParams
from mtplib.lab.projection.sweep import project
from mtplib.model.arch import CONVERTER_DTYPES, block_tensors, root_tensors, trunk_tensors
from mtplib.model.presets import (
    TINY,
    V4_FLASH,
    V4_FLASH_RATIOS,
    V4_FLASH_SLICE,
    V4_FLASH_SLICE_L4,
    get_preset,
)

REPO = Path(__file__).resolve().parent.parent
EXPERT_DIMS = {"ffn_gate_inp": 1, "ffn_gate_exps": 2, "ffn_up_exps": 2, "ffn_down_exps": 2,
               "exp_probs_b": 0}


# -- the preset -----------------------------------------------------------------------------
def test_slice_has_v4_flash_widths_kinds_and_dtypes():
    s, f = V4_FLASH_SLICE.validate(), V4_FLASH
    assert get_preset("v4-flash-slice") is V4_FLASH_SLICE
    for k in ("n_vocab", "n_embd", "n_head", "head_dim", "rope_dim", "q_lora", "o_groups",
              "o_lora", "n_expert_used", "n_ff_exp", "n_expert_shared", "n_hash_layers",
              "sliding_window", "indexer_heads", "indexer_dim", "indexer_top_k",
              "hc_sinkhorn_iters", "swiglu_clamp", "expert_weights_scale"):
        assert getattr(s, k) == getattr(f, k), k
    assert (s.n_embd, s.n_head, s.head_dim, s.n_expert_used) == (4096, 64, 512, 6)
    # V4-Flash's first six layers (two SWA, then CSA/HCA), then the MTP block
    assert s.compress_ratios[: s.n_layer] == V4_FLASH_RATIOS[:6] == (0, 0, 4, 128, 4, 128)
    assert s.compress_ratios[s.n_layer] == 0 and s.n_mtp == 1
    assert s.n_expert == 16 < f.n_expert  # fewer in total; per-token work the same
    assert not s.extra.get("weightless") and s.extra["dtype_policy"] == "converter"
    for i in range(s.n_blocks):
        j = i if i < s.n_layer else f.n_layer  # the MTP block is V4-Flash's block 43
        mine, real = block_tensors(s, i), block_tensors(f, j)
        assert [t.kind for t in mine] == [t.kind for t in real], i
        for a, b in zip(mine, real, strict=True):
            assert a.dtype == b.dtype == CONVERTER_DTYPES.get(a.kind, "F32") or \
                a.dtype == b.dtype == "F32", a.name
            ne = list(b.ne)
            if a.kind in EXPERT_DIMS:
                ne[EXPERT_DIMS[a.kind]] = s.n_expert
            if a.kind == "ffn_gate_tid2eid":
                assert a.ne == b.ne  # (6, vocab): values < n_expert
            assert tuple(ne) == a.ne, a.name
    assert [(t.name, t.ne, t.dtype) for t in root_tensors(s)] == \
        [(t.name, t.ne, t.dtype) for t in root_tensors(f)]
    # the partner is the slice's first four layers, tensor for tensor
    p = V4_FLASH_SLICE_L4.validate()
    assert p.n_layer == 4 and p.compress_ratios == (0, 0, 4, 128, 0)
    assert trunk_tensors(p) == trunk_tensors(s)[: len(trunk_tensors(p))]


# -- the dtype-faithful writer (a small converter-dtype config: the slice is GBs) -----------
SMALL = replace(TINY, extra={"dtype_policy": "converter"}).validate()


def _write_small(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    from mtplib.model.arch import sidecar_tensors
    from mtplib.model.fixture import _write_typed

    t, m = tmp_path / "small.gguf", tmp_path / "mtp-small.gguf"
    _write_typed(t, SMALL, trunk_tensors(SMALL), seed, False, "small")
    _write_typed(m, SMALL, sidecar_tensors(SMALL), seed, True, "mtp-small")
    return t, m


def test_typed_writer_layout_scales_and_determinism(tmp_path):
    import gguf
    from gguf.quants import dequantize

    t, _ = _write_small(tmp_path)
    r = gguf.GGUFReader(str(t))
    by = {x.name: x for x in r.tensors}
    specs = {s.name: s for s in trunk_tensors(SMALL)}
    assert set(by) == set(specs)
    seen = set()
    for name, s in specs.items():
        x = by[name]
        assert x.tensor_type.name == s.dtype, name
        assert tuple(int(d) for d in x.shape) == s.ne, name
        assert int(x.n_bytes) == s.nbytes, name
        seen.add(s.dtype)
        if s.dtype in ("Q8_0", "MXFP4", "BF16"):
            w = dequantize(np.asarray(x.data), x.tensor_type).astype(np.float64)
            assert np.isfinite(w).all(), name
            sd = 1 / np.sqrt(s.ne[0])  # every such kind here is a projection (fan-in ne[0])
            if s.kind != "token_embd" and s.kind != "output":
                assert 0.5 * sd < w.std() < 2.0 * sd, (name, w.std(), sd)
    assert seen >= {"F32", "BF16", "Q8_0", "MXFP4", "I32"}
    t2 = tmp_path / "again"
    t2.mkdir()
    a, _ = _write_small(t2)
    assert a.read_bytes() == t.read_bytes()  # same seed, same bytes


@pytest.mark.slow
def test_typed_files_decode_upstream_with_mtp(tmp_path):
    """Upstream loads the converter-dtype files (MXFP4 experts, Q8_0, BF16) and decodes:
    finite logits from the trunk and from the MTP block."""
    from mtplib.runtime.model import Context, ContextConfig, Model

    t, m = _write_small(tmp_path)
    with Model(t) as tm, Model(m, load_mtp=True) as sm:
        with Context(tm, ContextConfig(n_ctx=256, n_threads=1, n_rs_seq=4)) as tc, \
                Context(sm, ContextConfig(n_ctx=256, n_threads=1, mtp=True,
                                          nextn_rows="masked")) as mc:
            tc.decode(list(range(1, 9)), range(8), logits=True)
            assert np.isfinite(tc.logits_all(8)).all()
            tc.decode([3, 4, 5], range(8, 11), logits=True)  # a verify batch, rolled back
            assert tc.seq_rm(0, 8)
            row = np.random.default_rng(0).standard_normal((1, tm.n_embd_out))
            mc.decode([3], [8], logits=True, rows=row.astype(np.float32))
            assert np.isfinite(mc.logits(-1)).all()


# -- the layer-cost derivation ----------------------------------------------------------------
def test_distinct_experts():
    assert LC.distinct_experts(1, 16) == pytest.approx(6)
    assert [round(LC.distinct_experts(n, 256), 1) for n in (2, 3, 4)] == [11.9, 17.6, 23.2]
    assert [round(LC.distinct_experts(n, 16), 1) for n in (2, 3, 4)] == [9.8, 12.1, 13.6]
    with pytest.raises(InputError):
        LC.distinct_experts(2, 4)


def test_config_refuses_too_few_steps_and_bad_ks():
    with pytest.raises(InputError, match="steps must be an int >= 20"):
        LC.LayerCostConfig(steps=19).validate()
    with pytest.raises(InputError, match="ks must"):
        LC.LayerCostConfig(ks=(0,)).validate()
    with pytest.raises(InputError, match="n_ctx"):
        LC.LayerCostConfig(n_ctx=100).validate()


def _synthetic(cfg: LC.LayerCostConfig, head: float, layer: float, extra: float,
               mtp: float | None, rng: np.random.Generator) -> dict:
    """Timings of a model of ``n`` layers: head + n*layer*(1 + extra*k), small noise."""
    def series(n_layers: int, k: int) -> list[float]:
        t = head + n_layers * layer * (1 + extra * k)
        return list(t * (1 + 0.01 * rng.standard_normal(cfg.steps)))

    out = {}
    for name, n in (("slice", 6), ("partner", 4)):
        out[name] = {"plain": series(n, 0),
                     "verify": {str(k): series(n, k) for k in cfg.ks}}
    out["slice"]["mtp"] = list(np.full(cfg.steps, mtp))
    return out


def test_derive_recovers_known_costs():
    cfg = LC.LayerCostConfig(steps=40)
    rng = np.random.default_rng(1)
    head, layer, extra = 0.050, 0.010, 0.2
    raw = _synthetic(cfg, head, layer, extra, 0.030, rng)
    d = LC.derive(raw["slice"], raw["partner"], cfg)
    assert d["layer_ms"] == pytest.approx(10.0, rel=0.05)
    lo, hi = d["layer_ms_p10_p90"]
    assert lo < d["layer_ms"] < hi
    v4 = head + 43 * layer  # the partner's 4 layers + 39 more
    assert d["v4_flash_decode_ms"] == pytest.approx(v4 * 1e3, rel=0.02)
    assert d["layer_s"] == pytest.approx(v4 / 43, rel=0.02)
    # each extra token adds extra * layers of compute, none of the head's
    assert d["verify_token_cost"] == pytest.approx(extra * 43 * layer / v4, rel=0.05)
    assert d["draft_cost"] == pytest.approx(0.030 / v4, rel=0.02)


# -- the projection takes the measurement ------------------------------------------------------
def _result(**derived) -> dict:
    base = {"layer_s": 0.004, "verify_token_cost": 0.05, "draft_cost": 0.06,
            "layer_ms": 3.0, "layer_ms_p10_p90": [2.9, 3.1], "v4_flash_decode_ms": 172.0}
    return {"schema": LAYER_COST_SCHEMA, "command": "mtplib layer-cost ...",
            "config": {"steps": 30, "threads": 2},
            "hardware": {"label": "Some CPU, 2 logical cores", "gpus": []},
            "backend": {"gpu_devices": []}, "derived": {**base, **derived}}


def test_projection_uses_measured_compute_with_source_and_hardware(tmp_path):
    c = ComputeInputs.from_layer_cost(_result())
    assert c.name == "measured-cpu" and c.hardware == "Some CPU, 2 logical cores"
    assert "mtplib layer-cost" in c.source and c.steps == 30
    prm = c.params()
    assert (prm.layer_s, prm.verify_token_cost, prm.draft_cost) == (0.004, 0.05, 0.06)
    assert ASSUMED_COMPUTE.layer_s == ProjectionParams().layer_s == \
        pytest.approx(1 / (16.4 * 43))
    assert ASSUMED_COMPUTE.params() == ProjectionParams()
    g = ComputeInputs.from_layer_cost({**_result(), "hardware": {
        "label": "NVIDIA H200", "gpus": [{"name": "NVIDIA H200"}]},
        "backend": {"gpu_devices": ["CUDA0"]}})
    assert g.name == "measured-gpu"
    for bad in ({"schema": "x"}, {**_result(), "derived": {}}, [1]):
        with pytest.raises(InputError):
            ComputeInputs.from_layer_cost(bad)
    with pytest.raises(InputError, match="layer_s"):
        ComputeInputs.from_layer_cost(_result(layer_s=-1))
    f = tmp_path / "lc.json"
    f.write_text(json.dumps(_result()))
    got = load_compute(f)
    assert replace(got, source=c.source) == c and got.source.endswith("lc.json)")
    with pytest.raises(InputError, match="cannot read"):
        load_compute(tmp_path / "none.json")


def test_measured_compute_changes_the_projection(tmp_path):
    from mtplib.model.fixture import write_fixture
    from mtplib.ownership.derivation import inventory_from_paths

    pair = write_fixture(tmp_path, preset="v4-flash")
    inv = inventory_from_paths(pair.trunk, pair.sidecar)
    slow = ComputeInputs.from_layer_cost(_result(layer_s=0.1))
    a = compute_model(inv, ASSUMED_COMPUTE.params())
    b = compute_model(inv, slow.params())
    assert b.decode_s == pytest.approx(43 * 0.1) and a.decode_s == pytest.approx(61.0e-3,
                                                                               rel=1e-3)
    assert (b.verify_token_cost, b.draft_cost) == (0.05, 0.06)
    r = project(inv, plans=["0-42"], ks=(0, 2), rtts_ms=(0,), params=slow.params())
    # compute is the whole step but for the bytes on the one shard's link (1 Gbit/s)
    assert r[0]["compute_s_per_token"] == pytest.approx(43 * 0.1)
    assert r[0]["tok_s"] == pytest.approx(1 / (43 * 0.1), rel=0.01)


def test_committed_cpu_measurement_is_read_by_the_report():
    files = sorted(p for p in (REPO / "evidence" / "layer-cost").glob("*.json")
                   if p.name != "run_record.json")
    if not files:
        pytest.skip("no committed layer-cost result")
    for f in files:
        c = load_compute(f)
        d = json.loads(f.read_text())
        assert c.steps >= LC.MIN_STEPS
        assert len(d["raw"]["slice"]["plain"]) == len(d["raw"]["partner"]["plain"]) == c.steps
        der = d["derived_cpu"] if d.get("projection_basis") == "cpu" else d["derived"]
        assert c.layer_s == der["layer_s"] > 0
        assert (c.verify_token_cost, c.draft_cost) == (der["verify_token_cost"],
                                                       der["draft_cost"])
        # a CPU-time basis only for a one-thread run without a GPU
        if d.get("projection_basis") == "cpu":
            assert d["config"]["threads"] == 1 and not d["backend"]["gpu_devices"]


@pytest.mark.slow
def test_time_models_pairs_steps_and_feeds_derive(tmp_path):
    """`time_models` on a small converter-dtype pair (the slice's code path at tiny widths):
    one entry per step per series, positive, and `derive` takes them."""
    t, m = _write_small(tmp_path)
    cfg = LC.LayerCostConfig(steps=20, warmup=1, n_prompt=8, n_ctx=128, threads=1,
                             bootstrap=100)
    a, b = LC.time_models([(t, m), (t, None)], cfg)
    for raw in (a, b):
        assert len(raw["plain"]) == 20 and all(x > 0 for x in raw["plain"])
        assert set(raw["verify"]) == {"1", "2", "3"}
        assert all(len(v) == 20 for v in raw["verify"].values())
    assert len(a["mtp"]) == 20 and "mtp" not in b
    assert len(a["cpu"]["plain"]) == len(a["cpu"]["mtp"]) == len(b["cpu"]["verify"]["3"]) == 20
    assert all(x >= 0 for x in a["cpu"]["plain"])
    d = LC.derive(a, b, cfg)  # the same file twice: the "layer" is noise around 0
    assert d["draft_ms"] > 0 and np.isfinite(d["verify_token_cost"])
    # noise can make either figure negative, so check the paired formula, not a sign
    pa, pb = np.asarray(a["plain"]), np.asarray(b["plain"])
    layer = (pa - pb) / LC.DIFF_LAYERS
    assert d["layer_ms"] == pytest.approx(float(np.median(layer)) * 1e3)
    assert d["v4_flash_decode_ms"] == pytest.approx(
        float(np.median(pb + LC.EXTRA_LAYERS * layer)) * 1e3)


def test_amx_hosts_load_without_upstreams_extra_buffer_types(monkeypatch):
    """On an AMX build the CPU's AMX buffer would take V4's Q8_0 weights and upstream's
    scheduler then aborts (the typed-files test above): the check reads upstream's system
    info, and MTPLIB_EXTRA_BUFTS=1 keeps upstream's choice."""
    from mtplib.runtime import lib

    assert lib.has_amx("CPU : AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |")
    assert not lib.has_amx("CPU : AVX2 = 1 | FMA = 1 | OPENMP = 1 |")
    llama, _ = lib.load()
    info = llama.llama_print_system_info().decode()
    monkeypatch.delenv(lib.EXTRA_BUFTS_ENV, raising=False)
    assert lib.extra_bufts_ok() is (not lib.has_amx(info))
    monkeypatch.setenv(lib.EXTRA_BUFTS_ENV, "1")
    assert lib.extra_bufts_ok()
