"""The DSpark part of the DGR-065 README: the draft's ownership checked against upstream's
two graphs on the fixture, its caches against upstream's allocation, and what crosses per
placement at V4-Flash's sizes; plus its lines in the limitations and the handoff.

Every number comes from the run's raw metrics (the ``dspark`` keys notebooks 01 and 02
write, `mtplib.records.raw_metrics`). A run made before those keys existed gets the words
and what to re-run, no number: the section never invents one.
"""

from __future__ import annotations

from mtplib.records.readme import names, table, yes

RERUN = ("re-run notebooks 01_tensor_ownership and 02_state_contract (`mtplib run` of a "
         "lane with them, e.g. the default `params/cpu-fixture.yaml`), then `mtplib evidence "
         "--run RUN --story DGR-065`")

INTRO = (
    "MTP stays; DSpark is the second drafter, beside it (GGUF arch `dflash` with "
    "`markov_w1`, upstream's `draft-dspark`; the contract's recipes `dspark.v4.draft<k>`, "
    "`mtplib.contract.dspark`). Its ownership is derived from the draft's header and the "
    "trunk's (`mtplib.ownership.dspark`): each draft tensor's part and the graphs that read "
    "it, `inject` (an embd batch: the target's features through `fc` into each stage's K) "
    "and `block` (a token batch: the noise block through the stages and the Markov and "
    "confidence heads); the token embedding and the output head are the trunk's, read "
    "through `ctx_other`. `mtplib.runtime.dspark.graph_reads.check_dspark` runs one embd "
    "batch and one noise block on the runtime's own draft context with an eval callback and "
    "compares what upstream's graphs read (a weight is the trunk's when its buffer is one "
    "the target's decode read) and the draft context's cache buffers with the derivation.")


def _reads(ds: dict) -> list[str]:
    fx = ds["fixture"]
    d = fx["draft"]
    rows = [[x["graph"], str(x["derived"]), str(x["observed"]),
             names(x["missing_in_upstream"]), names(x["unexpected_in_upstream"]),
             yes(x["equal"])] for x in ds["reads"]]
    bad = ds["part_contradictions"]
    return [f"Fixture draft `{fx['file']}` beside the trunk, plan `{fx['plan']}`: "
            f"{d['n_stages']} stages, block size {d['block_size']}, target layers "
            f"`{d['target_layers']}` (upstream's ids + 1: the outputs of trunk layers "
            f"`{[t - 1 for t in d['target_layers']]}`), {d['n_tensors']} tensors, "
            f"{d['bytes']} bytes.", "",
            *table(["graph", "tensors derived as read", "tensors upstream read",
                    "missing in upstream", "unexpected in upstream", "equal"], rows), "",
            "Result: read_by " + ("equals" if ds["reads_equal"] else "does **not** equal")
            + " what both graphs read; every read fits its part: "
            + (yes(True) + "." if ds["parts_consistent"] else
               yes(False) + " (" + "; ".join(bad) + ")."), "",
            "Tensors by file, part and reading graph:", "",
            *table(["file", "part", "read by", "tensors", "bytes"],
                   [[x["file"], x["part"], x["read_by"], str(x["tensors"]), str(x["bytes"])]
                    for x in fx["parts"]]), ""]


def _features(ds: dict) -> list[str]:
    fx = ds["fixture"]
    rows = [[str(f["target_layer"]), str(f["trunk_layer"]), str(f["made_on"]),
             ", ".join(str(s) for s in f["seen_on"])] for f in fx["features"]]
    prow = [[f"`{p['placement']}`", p["holder"], str(p["draft_bytes"]),
             names([r["name"] for r in p["replicas"]]), str(p["replica_bytes"]),
             names(p["remote_features"]), str(p["feature_bytes_per_token"]),
             str(p["caches"]["total"])] for p in fx["placements"]]
    return ["Which trunk layers feed it, under the fixture's plan (a feature is made on the "
            "shard of the layer whose output it is, and seen also by the next layer's shard, "
            "which receives that residual at the seam):", "",
            *table(["target layer", "trunk layer (output of)", "made on shard",
                    "seen on shards"], rows), "",
            "What the draft needs where it runs (features in f32 bytes per committed token; "
            "caches at the fixture's context):", "",
            *table(["placement", "holder", "draft bytes", "trunk tensors copied",
                    "copied bytes", "features from elsewhere", "feature bytes per token",
                    "cache bytes"], prow), ""]


def _caches(sd: dict) -> list[str]:
    rows = []
    for c in sd["fixture_checks"]:
        p = c["params"]
        for b in c["buffers"]:
            rows.append([f"n_ctx {p['n_ctx']}, {p['n_seq']} seq, n_ubatch {p['n_ubatch']}, "
                         f"K `{p['type_k']}`, swa_full `{p['swa_full']}`", f"`{b['cache']}`",
                         str(b["tensors read"]), str(b["derived bytes"]),
                         str(b["upstream bytes"]), yes(b["equal"])])
    ok = all(c["caches_equal"] for c in sd["fixture_checks"])
    return ["The draft context's caches against upstream's allocation (same contexts as "
            "criterion 2): one SWA K per stage is touched, and the buffer also holds the V "
            "upstream allocates and never reads.", "",
            *table(["context", "cache buffer", "tensors read", "derived bytes",
                    "upstream bytes", "equal"], rows), "",
            "Result: the derived draft caches " + ("equal" if ok else "do **not** all equal")
            + " upstream's allocation for every context above.", ""]


def _crossings(sd: dict) -> list[str]:
    cr = sd["crossings"]
    pl = cr["placements"]
    rows = [[f"`{p}`", f"`{r['value']}`", r["direction"], r["per"], str(r["bytes"]),
             "option, not built" if r["option"] else "contract minimum"]
            for p, v in pl.items() for r in v["rows"]]
    steps = [[str(n), str(pl["client"]["step_bytes"][n]), str(pl["tail"]["step_bytes"][n])]
             for n in pl["client"]["step_bytes"]]
    frows = [[f"`{f['plan']}`", str(f["tail_first_layer"]), names(f["remote_layers"]),
              str(f["tail_feature_bytes_per_token"])] for f in sd["feature_plans"]]
    return [f"What crosses for DSpark at V4-Flash's sizes (target layers "
            f"`{cr['target_layers']}`; `mtplib.contract.dspark.dspark_crossings`), beyond a "
            "plain step's boundary values; for comparison MTP's hidden row per committed "
            f"token is {cr['mtp_row_bytes']} bytes in f32:", "",
            *table(["placement", "value", "direction", "per", "bytes", "kind"], rows), "",
            f"Bytes one step of {cr['k']} drafts adds, by drafts accepted (the committed "
            "tokens' features with the draft in the client; ids, the verify record, draft "
            "ids and confidences with it on the tail shard):", "",
            *table(["accepted", "client", "tail"], steps), "",
            "Features the tail shard does not see, per V4-Flash plan (their rows would come "
            "from the shard before):", "",
            *table(["plan", "tail's first layer", "target layers from elsewhere",
                    "bytes per token"], frows), ""]


def dspark_section(own: dict, st: dict) -> list[str]:
    """DSpark beside MTP: ownership, graphs, caches, crossings (one heading), from notebook
    01's (``own``) and 02's (``st``) raw metrics."""
    out = ["## DSpark beside MTP: ownership, graphs, caches and what crosses", "", INTRO, ""]
    ds, sd = own.get("dspark"), st.get("dspark")
    if ds is None and sd is None:
        return [*out, "This run's raw metrics have no DSpark part (they predate it), so this "
                "README states no DSpark number; to measure it, " + RERUN + ". "
                "The contract's DSpark rules are checked by its golden fixture "
                "(`tests/golden/contract/dspark_values.json`) and by "
                "`tests/test_contract_dspark.py` and `tests/test_ownership_dspark.py` (the "
                "graph check on the fixture).", ""]
    if ds is not None:
        out += [*_reads(ds), *_features(ds)]
    if sd is not None:
        out += [*_caches(sd), *_crossings(sd)]
    return out


def dspark_limitations() -> list[str]:
    """DSpark's lines of the limitations."""
    return ["- **DSpark at real scale is not derived from a file:** no V4-Flash DSpark GGUF "
            "is here (upstream's converter was not run), so its tensor bytes at real scale "
            "are not in this README; its crossings follow from the sizes alone, and where "
            "its features are made from the target layers and the plan. The fixture's draft "
            "has random weights: the graph check shows what upstream reads and allocates, "
            "not acceptance.",
            "- DSpark's read rules cover blocks up to the draft's block size (what the "
            "runtime runs); past it upstream skips the Markov head, which the contract "
            "refuses."]


def dspark_handoff(st: dict) -> list[str]:
    """DSpark's lines of the handoff (sizes from notebook 02's raw metrics ``st``)."""
    sd = st.get("dspark")
    sizes = ""
    if sd is not None:
        rows = {p: {x["value"]: x["bytes"] for x in v["rows"]}
                for p, v in sd["crossings"]["placements"].items()}
        cl, tl = rows["client"], rows["tail"]
        sizes = (f" ({cl['dspark_features']} bytes per committed token in the client; "
                 f"{tl['draft_tokens']} + {tl['dspark_confidences']} bytes per draft out of "
                 "the tail)")
    return ["- **DSpark:** a second drafter beside MTP (`dspark.v4.draft<k>`, disabled and "
            "unroutable under alpha as MTP is). Its state is its stages' SWA K caches, "
            "shard-local; what crosses is the committed tokens' features with the draft in "
            "the client, or ids in and drafts plus confidences out with it on the tail"
            + sizes + ". Ranged adverts offer DSpark recipes only where a run placed a "
            "draft (`shard_report.shard_adverts(dspark_block=...)`); "
            "`mtplib.runtime.dspark.graph_reads.check_dspark` re-checks a draft against "
            "upstream."]
