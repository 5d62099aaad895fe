"""The V4-Flash WAN projection (mtplib.lab.projection) on the weight-less V4-Flash table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mtplib.contract.labels import StepKind
from mtplib.errors import InputError
from mtplib.lab.projection.compute import active_bytes, compute_model
from mtplib.lab.projection.constants import ANCHOR_SPEEDUP_K2, VLLM_ACCEPTANCE
from mtplib.lab.projection.fit import fit_rows
from mtplib.lab.projection.graph_inputs import (
    hadamard_side,
    n_kv_comp,
    n_kv_raw,
    rotation_constants,
)
from mtplib.lab.projection.params import DEFAULT_SCENARIOS, ProjectionParams, Scenario
from mtplib.lab.projection.plots import plot_projection
from mtplib.lab.projection.structure import (
    GRAPH_SLOTS,
    MEASURED,
    SEAM_ONCE,
    STRUCTURES,
    WHOLE_GRAPH,
    MessageStructure,
    StepWaits,
)
from mtplib.lab.projection.sweep import project
from mtplib.lab.projection.traffic import CLASSES, step_traffic
from mtplib.model.fixture import write_fixture
from mtplib.model.trained import trained_paths
from mtplib.ownership.derivation import inventory_from_paths
from mtplib.ownership.plan import ShardPlan, even_plan, parse_plan
from mtplib.records.lanes import LaneError, check_gpus, load_lane
from mtplib.reports.upstream_patches import ring_projection
from mtplib.reports.wan import projection as projection_page

REPO = Path(__file__).resolve().parent.parent
H = 4 * 4096  # hc * n_embd of V4-Flash
VOCAB = 129280
TAIL_TAIL = Scenario(placement="tail", head="tail")
CLIENT_CLIENT = Scenario(placement="client", head="client")


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    pair = write_fixture(tmp_path_factory.mktemp("flash"), preset="v4-flash")
    return inventory_from_paths(pair.trunk, pair.sidecar)


@pytest.fixture(scope="module")
def trained():
    p = trained_paths()
    if not (p.trunk.exists() and p.sidecar.exists()):
        pytest.skip("the trained pair (evidence/trained-v4) is absent")
    return inventory_from_paths(p.trunk, p.sidecar)


# -- the rotation matrix ------------------------------------------------------------------
def test_hadamard_side_follows_upstreams_loop():
    # build_input_k_rot: nrot = 64; do nrot *= 2 while n % nrot == 0; nrot /= 2
    for n, side in [(128, 128), (512, 512), (1024, 1024), (384, 128), (64, 64), (96, 64),
                    (192, 64), (100, 64), (1, 64)]:
        assert hadamard_side(n) == side, n
    for bad in (0, -128, 128.0, True, "128"):
        with pytest.raises(InputError, match="head size"):
            hadamard_side(bad)


def test_rotation_constants_at_v4_flash_size(flash):
    cfg = flash.config
    assert rotation_constants(cfg) == {"lid": 128 * 128 * 4}  # 65,536 B, F16 K cache
    q = rotation_constants(cfg, "q8_0")  # a quantized K cache rotates raw/CSA/HCA too
    assert q == {"lid": 65536, "raw": 512 * 512 * 4, "csa": 512 * 512 * 4,
                 "hca": 512 * 512 * 4}
    with pytest.raises(InputError, match="type_k"):
        rotation_constants(cfg, "q4_x")
    # only a shard holding a ratio-4 (CSA) layer gets the indexer's matrix: layers 0-1
    # are SWA only on V4-Flash
    st = step_traffic(cfg, parse_plan("0-1,2-42", 43), "plain")
    assert [b["constants"] for b in st.bytes] == [0, 65536]
    assert "attn_inp_k_rot(lid)" in st.detail[1] and "attn_inp_k_rot(lid)" not in st.detail[0]


# -- traffic adds up ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_round_trips_and_bytes_add_up_per_class(flash, n, dtype):
    cfg = flash.config
    plan = even_plan(43, n)
    isz = {"bf16": 2, "f32": 4}[dtype]
    for head in ("tail", "client"):
        sc = Scenario(placement="tail", head=head, boundary_dtype=dtype)
        for kind, k in (("plain", 0), ("verify", 1), ("verify", 3)):
            st = step_traffic(cfg, plan, kind, k=k, scenario=sc)
            n_tok = 1 if kind == "plain" else k + 1
            tot = st.total()
            assert sum(tot.values()) == sum(sum(b.values()) for b in st.bytes)
            # the seam: 2 tensors of hc*n_embd per token, GET from shard i and SET into i+1
            assert tot["seam"] == (n - 1) * 2 * 2 * H * isz * n_tok
            out = VOCAB * 4 if head == "tail" else H * isz
            assert tot["output"] == out * n_tok and st.bytes[-1]["output"] == tot["output"]
            assert tot["mtp_rows"] == (H * 4 * n_tok if kind == "verify" and head == "tail"
                                       else 0)
            for i, b in enumerate(st.bytes):
                inputs = {t: v for t, v in st.detail[i].items() if not t.startswith(
                    ("attn_inp_k_rot", "logits", "hidden_rows", "h_nextn"))}
                assert b["graph_inputs"] == sum(inputs.values())
                assert b["constants"] == sum(v for t, v in st.detail[i].items()
                                             if t.startswith("attn_inp_k_rot"))
                assert st.sets[i] == len(inputs) + (b["constants"] > 0) + (2 if i else 0)
            # waits: 2 per seam + the sampler's rows (+1 for h_nextn on a head@tail verify)
            extra = 1 if kind == "verify" and head == "tail" else 0
            assert st.waits == [2.0] * (n - 1) + [1.0 + extra]
    for placement, draft_b in (("tail", True), ("client", False)):
        sc = Scenario(placement=placement, head="tail")
        d = step_traffic(cfg, plan, "draft", k=2, scenario=sc)
        assert (sum(d.total().values()) > VOCAB * 4) is draft_b
        assert sum(d.waits) == (2 if draft_b else 0)


def test_project_rows_add_up(flash):
    rows = project(flash, n_shards=(2, 4), rtts_ms=(0, 100))
    assert len(rows) == 2 * 2 * len(DEFAULT_SCENARIOS) * 4 * 2  # plan kinds x n x ...
    for r in rows:
        classes = sum(r[f"bytes_{c}_per_token"] for c in CLASSES)
        assert r["bytes_per_token"] == pytest.approx(classes)
        assert r["t_token_s"] == pytest.approx(
            r["compute_s_per_token"] + r["rtt_ms"] / 1e3 * r["waits_per_token"]
            + r["bytes_per_token"] * 8 / 1e9)
        if r["k"] == 0:
            assert r["waits_per_token"] == 2 * (r["n_shards"] - 1) + 1
            assert r["speedup"] == 1.0 and r["tokens_per_verify"] == 1.0
    tail_local = project(flash, plans=["0-21,22-42"], ks=(0,), rtts_ms=(100,),
                         scenarios=(replace(CLIENT_CLIENT, tail_local=True),))[0]
    assert tail_local["waits_per_token"] == 2  # the tail's wait is local


def test_trained_pair_message_counts_match_the_issue(trained):
    """Issue 14: per MTP-off token on plan 0-1,2-3, 20 SET + 2 GET on shard 0 (71.8 KB, of
    which 65,536 B attn_inp_k_rot) and 13 SET + 1 GET on shard 1."""
    st = step_traffic(trained.config, parse_plan("0-1,2-3", 4), "plain", scenario=TAIL_TAIL,
                      params=ProjectionParams(context=200, n_ctx=2048))
    assert st.sets == [20, 13] and st.waits == [2.0, 1.0]
    assert sum(st.bytes[0].values()) == 71808 and st.bytes[0]["constants"] == 65536


@pytest.mark.parametrize("n", [2, 3, 8])
def test_seam_once_structure_waits_once_per_shard(trained, flash, n):
    """patches/0002-0004 as measured on the trained pair: a plain decode waits once per
    shard, one boundary tensor crosses each seam, and no rotation matrix is re-sent."""
    for inv in (trained, flash):
        plan = even_plan(inv.config.n_layer, n) if n <= inv.config.n_layer else None
        if plan is None:
            continue
        once = step_traffic(inv.config, plan, "plain", scenario=CLIENT_CLIENT,
                            structure=SEAM_ONCE)
        stock = step_traffic(inv.config, plan, "plain", scenario=CLIENT_CLIENT)
        assert sum(once.waits) == n and sum(stock.waits) == 2 * (n - 1) + 1
        assert once.total()["constants"] == 0 < stock.total()["constants"]
        assert 2 * once.total()["seam"] == stock.total()["seam"]


def test_masks_follow_context_and_swa_full(flash):
    cfg = flash.config
    prm = ProjectionParams()
    assert n_kv_raw(cfg, prm, 100) == 256
    assert n_kv_raw(cfg, prm, 32768) == 32768
    assert n_kv_raw(cfg, prm, 40000) == 40192  # PAD(40000, 256)
    # without swa_full the raw cache is PAD(min(n_ctx, 128 + 512), 256) = 768 cells
    assert n_kv_raw(cfg, replace(prm, swa_full=False), 131072) == 768
    assert n_kv_comp(4, 1000) == 256 and n_kv_comp(4, 131072) == 32768
    assert n_kv_comp(128, 131072) == 1024
    one = step_traffic(cfg, even_plan(43, 2), "plain", params=replace(prm, context=131072))
    assert one.detail[0]["attn_inp_kq_mask"] == 131072 * 2  # F16 with flash attention
    f32 = step_traffic(cfg, even_plan(43, 2), "plain",
                       params=replace(prm, context=131072, flash_attn=False))
    assert f32.detail[0]["attn_inp_kq_mask"] == 131072 * 4


# -- fit ----------------------------------------------------------------------------------
def test_a_plan_that_fits_and_one_that_does_not(flash):
    whole, two = fit_rows(flash, ["0-42", "0-21,22-42"], contexts=(32768,))
    # DGR-065: trunk 156,373,008,732 B + sidecar 5,722,316,268 B
    assert whole["weights_bytes"] == 156_373_008_732 + 5_722_316_268
    assert not whole["fits"] and whole["headroom_bytes"] < 0
    assert two["fits"] and two["largest_shard"] == 1
    assert two["weights_bytes"] == 82_135_416_504
    assert two["need_bytes"] == two["weights_bytes"] + two["cache_bytes"] + 8 * 2**30
    tight = fit_rows(flash, ["0-21,22-42"], contexts=(32768,), capacity=80 * 10**9)[0]
    assert not tight["fits"]
    with pytest.raises(InputError, match="capacity"):
        fit_rows(flash, ["0-42"], capacity=0)


def test_lane_numbers_and_placement(flash):
    """The v4-flash-h200 lane's comment quotes these; upstream's default split over two
    equal GPUs gives the ranges of plan 0-21,22-42 (the output layer on the second)."""
    text = (REPO / "params" / "v4-flash-h200.yaml").read_text()
    r4k = fit_rows(flash, ["0-21,22-42"], contexts=(4096,))[0]
    r128k = fit_rows(flash, ["0-21,22-42"], contexts=(131072,))[0]
    assert f"{r4k['need_bytes'] / 1e9:.1f} GB" in text and "82,135,416,504" in text
    assert f"{r128k['need_bytes'] / 1e9:.1f} GB" in text
    assign = ShardPlan.parse("0-21,22-42", 43).upstream_assignment()
    assert assign == {il: 0 if il <= 21 else 1 for il in range(44)}
    lane = load_lane(REPO / "params" / "v4-flash-h200.yaml")
    assert lane.requires == {"gpus": 2, "gpu_memory_gb": 141.0,
                             "hardware": lane.requires["hardware"]}
    assert lane.bench["plans"] == ["whole"]


def test_lane_hardware_check():
    lane = load_lane(REPO / "params" / "v4-flash-h200.yaml")
    h200 = {"name": "CUDA0", "type": "gpu", "memory_total": 150_754_820_096}
    small = {"name": "CUDA1", "type": "gpu", "memory_total": 85_000_000_000}
    check_gpus(lane, [h200, {**h200, "name": "CUDA1"}])  # two H200s: runs
    for gpus in ([h200], [h200, small], []):
        with pytest.raises(LaneError, match=r"needs 2 local GPU\(s\) with >= 141 GB each"):
            check_gpus(lane, gpus)


def test_lane_stops_without_gpus(tmp_path):
    from mtplib.records.lanes import check_lane_requirements
    from mtplib.runtime.devices import gpu_devices

    lane = load_lane(REPO / "params" / "v4-flash-h200.yaml")
    if len(gpu_devices()) >= 2:
        pytest.skip("this machine has two GPUs")
    with pytest.raises(LaneError, match="two local GPUs of >= 141 GB each"):
        check_lane_requirements(lane)
    bad = tmp_path / "bad.yaml"
    bad.write_text("lane: x\nfixture: {preset: tiny}\nnotebooks: [04_benchmark.ipynb]\n"
                   "requires: {gpus: 2}\n")
    with pytest.raises(LaneError, match="'hardware'"):
        load_lane(bad)


# -- speed ----------------------------------------------------------------------------------
def test_speedup_approaches_tokens_per_verify_as_rtt_grows(flash):
    prm = ProjectionParams()
    for n in (2, 4, 8):
        rows = project(flash, plans=[even_plan(43, n)], rtts_ms=(0, 100, 1e4, 1e7),
                       scenarios=(CLIENT_CLIENT,))
        for k in (1, 2, 3):
            sp = [r["speedup"] for r in rows if r["k"] == k]
            t = prm.tokens_per_verify(k)
            assert sp == sorted(sp)  # grows with RTT
            assert sp[-1] == pytest.approx(t, rel=1e-4) and sp[0] < t
    # head on the tail: the h_nextn fetch caps 2 shards at 3/4 of the ideal (issue 14)
    far = project(flash, plans=["0-21,22-42"], ks=(2,), rtts_ms=(1e7,),
                  scenarios=(Scenario(placement="client", head="tail"),))[0]
    assert far["speedup_over_ideal"] == pytest.approx(0.75, rel=1e-4)


def test_compute_model_reproduces_its_calibration(flash):
    """Whole model, RTT 0, no bandwidth cost, vLLM acceptance, k=2: the PR's 1.5x."""
    prm = ProjectionParams(bandwidth_bps=1e30, acceptance=VLLM_ACCEPTANCE)
    r = project(flash, plans=["0-42"], ks=(2,), rtts_ms=(0,), scenarios=(TAIL_TAIL,),
                params=prm)[0]
    assert r["speedup"] == pytest.approx(ANCHOR_SPEEDUP_K2)
    cm = compute_model(flash, prm)
    assert cm.decode_s == pytest.approx(1 / 16.4)
    ab = active_bytes(flash)
    assert cm.draft_cost == pytest.approx(ab["mtp"] / ab["trunk"])
    assert 0 < ab["head"] < ab["mtp"] < ab["trunk"]
    fixed = compute_model(flash, replace(prm, verify_token_cost=0.0, draft_cost=0.5))
    assert fixed.verify_token_cost == 0.0 and fixed.draft_tail_s == pytest.approx(0.5 / 16.4)


# -- inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    ({"acceptance": (0.5, 0.7)}, "cannot grow"),
    ({"acceptance": (1.2,)}, "probabilities"),
    ({"acceptance": [0.7]}, "tuple"),
    ({"layer_s": 0}, "layer_s"),
    ({"bandwidth_bps": -1}, "bandwidth_bps"),
    ({"client_bw": float("nan")}, "client_bw"),
    ({"context": 200000}, "context"),
    ({"n_ubatch": 0}, "n_ubatch"),
    ({"type_k": "q4_x"}, "type_k"),
    ({"draft_cost": -0.1}, "draft_cost"),
    ({"swa_full": 1}, "swa_full"),
])
def test_params_validation(kw, msg):
    with pytest.raises(InputError, match=msg):
        ProjectionParams(**kw)


def test_other_validation(flash):
    for kw, msg in [({"placement": "gpu"}, "placement"), ({"head": "shard"}, "head"),
                    ({"boundary_dtype": "int8"}, "boundary dtype"),
                    ({"tail_local": "yes"}, "tail_local")]:
        with pytest.raises(InputError, match=msg):
            Scenario(**kw)
    with pytest.raises(InputError, match="StepWaits.tail"):
        StepWaits(tail=-1)
    with pytest.raises(InputError, match="seam_tensors"):
        MessageStructure(seam_tensors=0)
    with pytest.raises(InputError, match="k=4 needs 4 acceptance"):
        project(flash, plans=["0-42"], ks=(4,))
    with pytest.raises(InputError, match="ks must"):
        project(flash, plans=["0-42"], ks=(-1,))
    with pytest.raises(InputError, match="rtts_ms"):
        project(flash, plans=["0-42"], rtts_ms=(-5,))
    with pytest.raises(InputError, match="plan kind"):
        project(flash, n_shards=(2,), plan_kinds=("random",))
    with pytest.raises(InputError, match="step kind"):
        step_traffic(flash.config, even_plan(43, 2), "prefill")
    with pytest.raises(InputError, match="draft length"):
        step_traffic(flash.config, even_plan(43, 2), "verify", k=0)


def test_graph_and_control_bytes_reproduce_their_measurements(trained):
    """On the trained pair (4 layers, plan 0-1,2-3, k=2) the counting gives back the relays'
    figures it was built from; the 6-layer point follows from the per-layer estimate; the
    structures of sections 1-4 count no graph or control bytes."""
    plan = parse_plan("0-1,2-3", trained.config.n_layer)
    sc = Scenario(placement="client", head="client")

    def tot(st, kind):
        return step_traffic(trained.config, plan, kind, k=2, structure=st,
                            scenario=sc).total()

    assert tot(WHOLE_GRAPH, "verify")["graph"] == 329_064
    assert tot(GRAPH_SLOTS, "verify")["graph"] == 16
    assert tot(WHOLE_GRAPH, "plain")["graph"] == tot(GRAPH_SLOTS, "plain")["graph"] == 16
    assert tot(GRAPH_SLOTS, "verify")["control"] == 13_864
    assert tot(GRAPH_SLOTS, "plain")["control"] == 10_410
    # the fixture's 6 layers on 2 shards (plan 0-2,3-5): 3 layers per shard pass
    assert 2 * GRAPH_SLOTS.control_bytes(StepKind.VERIFY, 3) == 20_772
    for st in STRUCTURES.values():
        assert tot(st, "verify")["graph"] == tot(st, "verify")["control"] == 0


def test_transfer_time_is_bytes_over_the_link_bandwidth(flash):
    """Between two link bandwidths a token's time differs by exactly its bytes x 8 x
    (1/b1 - 1/b2); a lower bandwidth is never faster."""
    rows = {}
    for mbit in (20, 1000):
        prm = ProjectionParams(bandwidth_bps=mbit * 1e6)
        for r in project(flash, plans=["0-21,22-42"], ks=(0, 2), rtts_ms=(100,),
                         scenarios=(Scenario(),), structure=WHOLE_GRAPH, params=prm):
            rows[(mbit, r["k"])] = r
            assert r["structure"] == "whole_graph"
    for k in (0, 2):
        slow, fast = rows[(20, k)], rows[(1000, k)]
        assert slow["bytes_per_token"] == fast["bytes_per_token"] > 0
        assert slow["t_token_s"] - fast["t_token_s"] == pytest.approx(
            slow["bytes_per_token"] * 8 * (1 / 20e6 - 1 / 1e9))
        assert slow["tok_s"] < fast["tok_s"]
    # the whole graph on every verify step: MTP on loses at 20 Mbit/s on V4-Flash's sizes
    assert rows[(20, 2)]["speedup"] < 1 < rows[(1000, 2)]["speedup"]
    assert rows[(20, 2)]["bytes_graph_per_token"] > rows[(20, 2)]["bytes_seam_per_token"]


@pytest.mark.parametrize("kw", [{"graph_bytes_per_pass": -1},
                                {"control_bytes_per_layer": float("nan")},
                                {"graph_bytes_per_layer_verify": True},
                                {"control_plain_scale": float("inf")}])
def test_graph_and_control_inputs_are_checked(kw):
    name = next(iter(kw))
    with pytest.raises(InputError, match=f"MessageStructure.{name} must be a finite number"):
        MessageStructure(**kw)


def test_structure_from_a_wan_run():
    run = {"n_shards": 2, "head": "tail",
           "waits": {"plain": [2, 1], "verify": [2, 2], "draft": [0, 2]}}
    assert MessageStructure.from_run(run) == replace(MEASURED,
                                                     source="a WAN run (from_run)")
    three = MessageStructure.from_run({"n_shards": 3, "head": "client",
                                       "waits": {"plain": [3, 2, 1], "verify": [3, 2, 1]},
                                       "source": "run-x"})
    assert three.plain == StepWaits(per_seam=2, fixed=1, tail=1)
    assert three.verify_head_client == three.plain and three.source == "run-x"
    assert three.plain.on_shards(3) == [3.0, 2.0, 1.0]
    for bad, msg in [({"n_shards": 2, "waits": {"plain": [2]}}, "must list 2"),
                     ({"n_shards": 2, "waits": {"prefill": [1, 1]}}, "unknown step kinds"),
                     ({"n_shards": 2, "waits": {"plain": [1, -1]}}, "must list 2"),
                     ({"n_shards": 0, "waits": {"plain": [1]}}, "n_shards"),
                     ({"n_shards": 2, "waits": {"plain": [1, 1]}}, "fewer waits"),
                     ({"n_shards": 2, "head": "gpu", "waits": {"plain": [2, 1]}}, "head")]:
        with pytest.raises(InputError, match=msg):
            MessageStructure.from_run(bad)


# -- plot and the evidence page ------------------------------------------------------------
def test_plot_projection(flash):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = project(flash, plans=["0-21,22-42"], scenarios=(CLIENT_CLIENT,))
    for metric in ("tok_s", "speedup"):
        ax = plot_projection(rows, metric=metric)
        assert "0-21,22-42" in ax.get_title() and "(ms)" in ax.get_xlabel()
        assert ("tokens/s" if metric == "tok_s" else "(x)") in ax.get_ylabel()
        lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
        assert len(lines) == 4 and len({ln.get_color() for ln in lines}) == 4
        leg = ax.get_legend()
        assert leg is not None and leg.get_bbox_to_anchor().x0 > ax.bbox.x1 - 1
        plt.close(ax.figure)
    with pytest.raises(InputError, match="no rows for plan"):
        plot_projection(rows, plan="0-42")
    with pytest.raises(InputError, match="metric"):
        plot_projection(rows, metric="waits")


def _png_software(data: bytes) -> str | None:
    """The ``Software`` text chunk of a PNG (matplotlib writes its version there)."""
    i = 8
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        if data[i + 4:i + 8] == b"tEXt" and data[i + 8:i + 8 + n].startswith(b"Software\0"):
            return data[i + 17:i + 8 + n].decode("latin-1")
        i += 12 + n
    return None


def test_committed_projection_page_is_current(flash, trained):
    """evidence/wan/PROJECTION.md is what `mtplib.reports.wan.projection` renders now."""
    mod = projection_page
    from mtplib.model.fixture import sha256_header

    paths = flash.paths
    hashes = {"trunk": sha256_header(Path(paths["trunk"])),
              "sidecar": sha256_header(Path(paths["mtp"]))}
    text = mod.render(flash, hashes, trained)
    assert text == (REPO / "evidence" / "wan" / "PROJECTION.md").read_text()


def test_committed_projection_plot_is_current(flash, tmp_path):
    """evidence/wan/projection.png is, byte for byte, what `mtplib.reports.wan.projection` plots now
    (with the matplotlib version that wrote it: another one renders other bytes)."""
    import matplotlib

    want = (REPO / "evidence" / "wan" / "projection.png").read_bytes()
    wrote = _png_software(want)
    if wrote != f"Matplotlib version{matplotlib.__version__}, https://matplotlib.org/":
        pytest.skip(f"projection.png was written by {wrote!r}, this is matplotlib "
                    f"{matplotlib.__version__}")
    mod = projection_page
    mod.plot(flash, tmp_path / "projection.png", mod.main_compute(mod.computes()).params())
    assert (tmp_path / "projection.png").read_bytes() == want


def test_committed_ring_projection_table_is_current(capsys):
    """The table of evidence/upstream-patches/shard-to-shard.md is what
    `mtplib.reports.upstream_patches.ring_projection` prints now."""
    assert ring_projection.main([]) == 0
    table = capsys.readouterr().out.strip()
    assert table.count("\n") == 16  # header, rule, 3 shard counts x 5 RTTs
    assert table in (REPO / "evidence" / "upstream-patches" / "shard-to-shard.md").read_text()
