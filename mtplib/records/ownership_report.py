"""The DGR-065 evidence README (MTP and DSpark ownership and the distributed state
contract), one
function per section, every number formatted from the run's raw metrics:
``run_record.json`` and notebooks 01/02's ``dgr065_ownership.json`` and
``dgr065_state.json`` (`mtplib.records.raw_metrics`).

Each section takes a `Run` (the raw metrics plus the links of the README being written)
and returns its lines, ending with a blank one; `render` joins `SECTIONS` in order. A
section can be called on its own (tests do, on the committed run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtplib.errors import InputError
from mtplib.records.ownership_dspark import dspark_handoff, dspark_limitations, dspark_section
from mtplib.records.raw_metrics import OWNERSHIP_JSON, STATE_JSON
from mtplib.records.readme import (
    Links,
    changed_files_section,
    dependency_section,
    fmt,
    model_rows,
    names,
    run_rows,
    table,
    tests_section,
    yes,
)
from mtplib.stamps import sha256_file

STORY = "DGR-065"
NOTEBOOKS = ("01_tensor_ownership.ipynb", "02_state_contract.ipynb")
RAW = (OWNERSHIP_JSON, STATE_JSON)

TRACE_RULE = (
    "A number in this README traces to the raw metrics when formatting some numeric value "
    "of `run_record.json`, `dgr065_ownership.json`, `dgr065_state.json` or "
    "`tests-DGR-065.json` (or a numeric key there) with the same number of decimals gives "
    "the same text. Byte counts are written "
    "without thousands separators so that each one is a single number. Not numbers, by "
    "rule: "
    "headings (lines starting with `#`), code spans in backticks (commands, paths, hashes, "
    "plans, dates), link targets, and words that contain a letter or one of `§#@` "
    "(identifiers such as V4-Flash, DGR-066, `k=1`).")

#: The cache kinds of the whole-model cache table, in column order.
CACHE_KEYS = ("raw_swa_k", "csa_compressed_k", "hca_compressed_k", "indexer_k",
              "compressor_state", "mtp_swa_k", "mtp_swa_v_unread", "raw_swa_k_unread", "total")

_REPLICA_HEADER = ["shard", "kind", "tensor", "bytes", "read by", "provided by / duplicate of"]


def _replica_rows(reps: list[dict]) -> list[list[str]]:
    return [[str(r["shard"]), r["kind"], f"`{r['file']}:{r['name']}`", str(r["bytes"]),
             "+".join(r["read_by"]) or "none",
             r.get("provided_by") or f"`{r.get('duplicate_of')}`"] for r in reps]


@dataclass(frozen=True)
class Run:
    """A run's raw metrics as the sections read them (``own``: notebook 01's, ``st``:
    notebook 02's)."""

    run_dir: Path
    link: Links
    rec: dict
    own: dict
    st: dict
    #: ``tests-DGR-065.json``: the criterion tests' results, None where they were not run
    tests: dict | None = None

    @classmethod
    def from_raw(cls, run_dir: Path, raw: dict, link: Links) -> Run:
        """``raw`` as `mtplib.records.evidence.load_raw` returns it; refuses a run without
        notebooks 01/02's metrics, or with metrics of older notebooks."""
        missing = [n for n, k in zip(RAW, ("ownership", "state"), strict=True)
                   if k not in raw]
        if missing:
            raise InputError(f"{run_dir}: no {', '.join(missing)}: the lane did not run "
                             "notebooks 01_tensor_ownership and 02_state_contract")
        own, st = raw["ownership"], raw["state"]
        if "fixture_reads" not in own or "fixture_checks" not in st:
            raise InputError(f"{run_dir}: {RAW} were written by older notebooks (no "
                             "fixture_reads / fixture_checks); rerun notebooks 01 and 02")
        return cls(run_dir, link, raw["run_record"], own, st, raw.get("tests"))

    @property
    def fx(self) -> dict:
        """The fixture's part of notebook 01's metrics."""
        return self.own["fixture"]

    @property
    def cpu(self) -> dict:
        return self.rec.get("cpu", {})

    @property
    def n_shards(self) -> list[int]:
        """The V4-Flash shard counts, ascending."""
        return sorted(int(n) for n in self.own["flash_shards"])

    @property
    def n_max(self) -> int:
        return self.n_shards[-1]

    @property
    def shard_words(self) -> str:
        return "/".join(str(n) for n in self.n_shards)

    @property
    def tail_replicas(self) -> list[dict]:
        """Replicas and duplicates of the largest plan."""
        return self.own["flash_replicas"][str(self.n_max)]

    @property
    def totals(self) -> list[dict]:
        """Whole-model cache bytes of the largest plan, one row per (n_ctx, swa_full)."""
        return [r for r in self.st["flash_totals"] if r["shards"] == self.n_max]

    @property
    def ctxs(self) -> list[int]:
        return sorted({r["n_ctx"] for r in self.totals})

    @property
    def seam(self) -> dict:
        return self.st["seam_bytes_per_token"]


# -- header and the run -----------------------------------------------------------------
def header(r: Run) -> list[str]:
    link = r.link
    return ["# DGR-065: MTP and DSpark ownership and the distributed state contract", "",
            "Generated by `mtplib.records.evidence` from the raw metrics of run "
            f"`{Path(r.rec['run_dir']).name}` "
            f"({link(OWNERSHIP_JSON)}, {link(STATE_JSON)}, "
            f"{link('run_record.json')}). Do not edit: `mtplib evidence --run RUN_DIR "
            "--story DGR-065` rewrites it, and `tests/test_evidence_dgr065.py` checks that "
            "every number here appears in those files (rule at the end).", ""]


def the_run(r: Run) -> list[str]:
    """How to repeat the run, what it ran on, and the hashes of this story's files."""
    rec, cpu, link = r.rec, r.cpu, r.link
    notebooks = {n["notebook"]: n for n in rec.get("notebooks", [])}
    nb_cells = []
    for name in NOTEBOOKS:
        e = notebooks.get(name)
        nb_cells.append(f"{link(name)} ({'not run' if e is None else e.get('status')}, "
                        f"`{e and e.get('started')}` to `{e and e.get('ended')}`)")
    rows = [
        *run_rows(rec),
        ["CPU", f"`{cpu.get('model')}`, {cpu.get('logical_cores')} logical cores, "
                f"{cpu.get('mem_total_bytes')} bytes of memory"],
        ["GPU", ", ".join(f"`{g['name']}`" for g in rec.get("gpu") or []) or "none"],
        ["Python", f"`{rec.get('python')}` on `{rec.get('platform')}`"],
        ["network", f"`{rec.get('network')}`"],
        ["notebooks of this story", "; ".join(nb_cells)],
    ]
    rows += model_rows(rec, "fixture model")
    arts = []
    for name in (*NOTEBOOKS, *RAW):
        p = r.run_dir / name
        arts.append([link(name), f"`{sha256_file(p)}`" if p.exists() else "missing"])
    return ["## The run", "", *table(["", ""], rows), "",
            "Artifacts of this story in the run (sha256 of the files as they are beside this "
            "README's run):", "", *table(["file", "sha256"], arts), "",
            "`run_record.json` is not hashed here: the pipeline completes it (end time, "
            "status, the READMEs written) after this README. The weight-less V4-Flash files "
            "are not kept as evidence (they are rebuilt deterministically by `mtplib fixture "
            "--preset v4-flash`); their header hashes are in criterion 3 below.", ""]


# -- criterion 1: reads -----------------------------------------------------------------
def criterion_1_reads(r: Run) -> list[str]:
    """Derived read_by against the tensors upstream's graphs read, on the fixture."""
    fx, own = r.fx, r.own
    out = ["## Criterion 1: derived read_by equals the upstream graphs' reads (fixture)", "",
           f"Fixture: the tiny random-weight DeepSeek-V4 pair of this run ({fx['n_layer']} "
           f"trunk layers + {fx['n_mtp']} MTP block, layout `{fx['layout']}`), plan "
           f"`{fx['plan']}`, n_ctx {fx['ctx']}. `mtplib.runtime.graph_reads.check_pair` runs "
           "one main decode on the trunk and one MTP decode on the sidecar; the context's "
           "eval callback records every weight tensor any graph node reads (through views "
           "too), and the set is compared with the tensors whose derived `read_by` names "
           "that graph. The same is done for one file holding trunk and MTP (upstream's "
           f"single-file layout, loaded with `load_mtp`). Notebook: {r.link(NOTEBOOKS[0])}.",
           ""]
    rrows = [[layout, x["graph"], f"`{x['file']}`", str(x["derived"]), str(x["observed"]),
              names(x["missing_in_upstream"]), names(x["unexpected_in_upstream"]),
              yes(x["equal"])]
             for layout, reads in own["fixture_reads"].items() for x in reads]
    out += table(["layout", "graph", "file", "tensors derived as read",
                  "tensors upstream read", "missing in upstream", "unexpected in upstream",
                  "equal"], rrows)
    eq = own["fixture_reads_equal"]
    out += ["", "Result: read_by equals the graphs' reads for "
            + ("both layouts." if all(eq.values()) else
               "**not** every layout: " + ", ".join(f"{k} {yes(v)}" for k, v in eq.items())
               + "."), ""]
    out += ["Tensors by file, role and reading graph (pair layout):", "",
            *table(["file", "role", "read by", "tensors", "bytes"],
                   [[x["file"], x["role"], x["read_by"], str(x["tensors"]), str(x["bytes"])]
                    for x in fx["roles"]]), ""]
    out += ["Shipped but read by no graph: "
            + (", ".join(f"`{u['file']}:{u['name']}` ({u['bytes']} bytes)"
                         for u in fx["unread"]) or "none") + ".", ""]
    out += [f"Replicas and duplicates on the fixture's tail shard under plan `{fx['plan']}`:",
            "", *table(_REPLICA_HEADER, _replica_rows(fx["replicas"])), ""]
    return out


# -- criterion 2: caches ----------------------------------------------------------------
def _context_check(c: dict) -> list[str]:
    p = c["params"]
    return [f"**Context:** n_ctx {p['n_ctx']}, {p['n_seq']} sequence(s), n_ubatch "
            f"{p['n_ubatch']}, K type `{p['type_k']}`, swa_full `{p['swa_full']}`, n_rs_seq "
            f"{p['n_rs_seq']}; cache tensors equal (main, MTP): "
            + ", ".join(yes(t) for t in c["tensors_equal"])
            + f"; every buffer equal: {yes(c['caches_equal'])}.", "",
            *table(["context", "cache buffer", "tensors read", "derived bytes",
                    "upstream bytes", "equal"],
                   [[b["context"], f"`{b['cache']}`", str(b["tensors read"]),
                     str(b["derived bytes"]), str(b["upstream bytes"]), yes(b["equal"])]
                    for b in c["buffers"]]), ""]


def criterion_2_caches(r: Run) -> list[str]:
    """Derived cache bytes against upstream's allocation, context by context."""
    checks = r.st["fixture_checks"]
    out = ["## Criterion 2: derived cache bytes equal upstream's allocation (fixture)", "",
           "For each context below, the same two decodes record every cache tensor the "
           "graphs touch (name, shape, type, bytes) and the size of each cache buffer "
           "upstream allocates (`ggml_backend_buffer_get_size`); the derived tensors must "
           "equal the touched ones and each derived buffer size must equal upstream's. "
           "Notebook: " + r.link(NOTEBOOKS[1]) + ".", ""]
    for c in checks:
        out += _context_check(c)
    allc = all(c["caches_equal"] and all(c["tensors_equal"]) for c in checks)
    out += ["Result: derived cache bytes " + ("equal" if allc else "do **not** all equal")
            + " upstream's allocation, tensor by tensor and buffer by buffer, for every "
            "context above. The MTP context's buffer includes a V cache its graph never "
            "reads (`mtp_swa_v_unread` in the tables below): the derivation counts it "
            "because upstream allocates it.", ""]
    return out


# -- criterion 3: V4-Flash --------------------------------------------------------------
def _flash_files(r: Run) -> list[str]:
    ff, own = r.own["flash_files"], r.own
    return ["`mtplib fixture --preset v4-flash` writes the trunk and sidecar tensor tables "
            "of the published V4-Flash config with the dtypes of upstream's converter "
            "mapping; the data region is a sparse hole (weight-less), so only headers are "
            "read.", "",
            *table(["file", "logical bytes", "bytes on disk", "header sha256"],
                   [[f"`{ff[k]['file']}`", str(ff[k]["bytes"]), str(ff[k]["disk_bytes"]),
                     f"`{ff[k]['sha256_header']}`"] for k in ("trunk", "sidecar")]), "",
            "Upstream's own loader accepts the tables: each file loaded with `no_alloc` "
            "(metadata only, nothing read or allocated, in a child process); its model size "
            "is compared with the derived bytes:", "",
            *table(["file", "`load_mtp`", "upstream model size", "derived bytes",
                    "upstream parameters", "equal"],
                   [[f"`{t['file']}`", f"`{t.get('load_mtp')}`", str(t.get("model_size")),
                     str(t["derived_bytes"]), str(t.get("n_params")), yes(t["equal"])]
                    for t in own["table_check"]]), ""]


def _derivation_time(r: Run) -> list[str]:
    own, st, link = r.own, r.st, r.link
    lim = own["derivation_limit_seconds"]
    under = max(own["derivation_seconds"], st["derivation_seconds"]) < lim
    return [f"**Derivation time** (reading both headers plus every derivation, "
            f"`ownership_report.flash_ownerships`): {fmt(own['derivation_seconds'], 3)} s "
            f"for {own['derivations']} derivations in {link(NOTEBOOKS[0])}, "
            f"{fmt(st['derivation_seconds'], 3)} s for {st['derivations']} derivations "
            f"({r.shard_words} shards × every context × swa_full on and off) in "
            f"{link(NOTEBOOKS[1])}; both notebooks assert under {lim} s, and "
            + ("both times are under it." if under else "**a time is over it**."), ""]


def _shard_bytes(r: Run) -> list[str]:
    own = r.own
    srows = [[str(n), f"`{s['plan']}`", str(s["shard"]), f"`{s['layers']}`", str(s["bytes"]),
              fmt(s["GiB"], 3), str(s["mtp"]), str(s["replica_bytes"]),
              str(s["duplicate_bytes"]), str(s["cache_bytes"])]
             for n in r.n_shards for s in own["flash_shards"][str(n)]]
    return [f"**Bytes held per shard** (even layer splits, n_ctx {own['flash_ctx']} for the "
            "cache column; the last shard holds the tail, and the MTP sidecar when the MTP "
            "block runs there, placement `tail`):", "",
            *table(["shards", "plan", "shard", "layers", "bytes", "GiB", "MTP sidecar bytes",
                    "replica bytes", "duplicate bytes", "cache bytes"], srows), "",
            "Largest shard, even plan against a byte-balanced plan "
            "(`ownership.balanced_plan`):", "",
            *table(["shards", "plan", "ranges", "largest shard GiB"],
                   [[str(p["shards"]), p["plan"], f"`{p['ranges']}`",
                     fmt(p["largest shard GiB"], 3)] for p in own["flash_plans"]]), ""]


def _mtp_block(r: Run) -> list[str]:
    own = r.own
    mtp_file = next((t for t in own["table_check"] if t["file"] == "mtp"), None)
    n_layer = next((t.get("n_layer") for t in own["table_check"] if t["file"] == "trunk"),
                   None)
    return [f"**MTP block bytes** (`blk.{n_layer}.*`, the sidecar's own block): "
            f"{own['mtp_block_bytes']}"
            + (f"; the whole sidecar is {mtp_file['derived_bytes']} bytes (with its "
               "embedding, head and norms)." if mtp_file else "."), ""]


def _flash_replicas(r: Run) -> list[str]:
    reps = r.own["flash_replicas"]

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in x.items() if k != "shard"} for x in rows]

    same = all(strip(reps[str(n)]) == strip(reps[str(r.n_max)]) for n in r.n_shards)
    return [f"**Replicas and duplicates** ({r.n_max} shards; "
            + ("the same tensors, on the tail shard, for every shard count above" if same
               else "they differ by shard count: see `flash_replicas` in the raw metrics")
            + "):", "", *table(_REPLICA_HEADER, _replica_rows(r.tail_replicas)), ""]


def _cache_totals(r: Run) -> list[str]:
    st = r.st

    def cols(n: int) -> list:
        return sorted(((x["n_ctx"], x["swa_full"]), [x[k] for k in CACHE_KEYS])
                      for x in st["flash_totals"] if x["shards"] == n)

    same_tot = all(cols(n) == cols(r.n_max) for n in r.n_shards)
    return ["**Cache bytes, whole model** (every cache kind summed over the shards of the "
            f"{r.n_max}-shard plan; "
            + (f"the sums are identical for {r.shard_words} shards" if same_tot else
               "the sums differ by shard count: see `flash_totals` in the raw metrics")
            + "). These are the derivation's formulas at real scale, not an allocation (see "
            "Limitations):", "",
            *table(["n_ctx", "swa_full", *[f"`{k}`" for k in CACHE_KEYS]],
                   [[str(x["n_ctx"]), f"`{x['swa_full']}`", *[str(x[k]) for k in CACHE_KEYS]]
                    for x in r.totals]), ""]


def _cache_per_shard(r: Run) -> list[str]:
    flash, n_max = r.st["flash"], r.n_max

    def key(c: int, f: bool) -> str:
        return f"{n_max}x{c}x{'full' if f else 'window'}"

    cols = [(c, f) for c in r.ctxs for f in (True, False) if key(c, f) in flash]
    per = {col: flash[key(*col)] for col in cols}
    return [f"Cache bytes per shard, {n_max} shards (column: n_ctx, swa_full):", "",
            *table(["shard", "layers", *[f"{c} `{'full' if f else 'window'}`" for c, f in cols]],
                   [[str(s["shard"]), f"`{s['layers']}`",
                     *[str(per[col][i]["total"]) for col in cols]]
                    for i, s in enumerate(per[cols[0]])] if cols else []), ""]


def _seam(r: Run) -> list[str]:
    seam = r.seam
    dts = list(seam["per_seam"])
    vals = list(seam["per_seam"][dts[0]])
    return [f"**Seam bytes per token** (`mtplib.contract.seam_bytes_per_token`, per seam; a "
            f"plan of {r.n_max} shards has {seam['n_seams']} seams):", "",
            *table(["value", *[f"{d} rows" for d in dts]],
                   [[f"`{v}`", *[str(seam["per_seam"][d][v]) for d in dts]] for v in vals]),
            "", *_placements(r), ""]


def _placements(r: Run) -> list[str]:
    """What crosses for MTP in each placement of its block (`--mtp-placement`): the
    client, the default, or the tail shard."""
    per = r.seam["per_seam"]
    row = " / ".join(f"{per[d]['mtp_hidden_remote']} bytes in {d}" for d in per)
    return [
        "What crosses for MTP depends on where its block runs (`--mtp-placement`; "
        "`mtplib.contract.seam.SEAM_VALUES`):", "",
        "- **In the client** (placement `client`, the default): the tail shard sends the "
        "client its pre-head rows "
        f"as `sampler_hidden`, one hc*n_embd row per verified position ({row}, the "
        "`mtp_hidden_remote` row above), in the same wait as a plain step; the client's "
        "output head (`--head auto` for ranged MTP) and the MTP block both read them "
        "there, so drafting and feeding the drafter cost no round trip. Logits do not "
        "cross.",
        "- **On the tail shard** (placement `tail`): the MTP block reads the tail's rows "
        "in place (`mtp_hidden`), so no hidden row crosses for it; each draft is a round "
        "trip to the tail, whose contract minimum is `draft_step` (the draft id). The "
        "tail still sends the client what its head needs, as in a plain step."]


def criterion_3_flash(r: Run) -> list[str]:
    """DeepSeek-V4-Flash at real scale: tables, loader check, time, bytes, caches, seams."""
    return ["## Criterion 3: DeepSeek-V4-Flash at real scale", "",
            *_flash_files(r), *_derivation_time(r), *_shard_bytes(r), *_mtp_block(r),
            *_flash_replicas(r), *_cache_totals(r), *_cache_per_shard(r), *_seam(r)]


# -- criterion 4: contract --------------------------------------------------------------
def criterion_4_contract(r: Run) -> list[str]:
    """The contract's golden fixtures and the alpha policy."""
    g, pol = r.st["golden"], r.st["policies"]
    alpha = pol.get("alpha", {})
    return ["## Criterion 4: contract golden fixtures and the alpha policy", "",
            f"{r.link(NOTEBOOKS[1])} writes the contract's golden fixtures afresh "
            f"(`mtplib.contract.golden.check_golden`, what `python -m mtplib.contract.golden "
            f"--check {g['dir']}` runs) and compares them byte for byte with the committed "
            f"ones in `{g['dir']}`: "
            + ("every fixture regenerated byte-identically." if g["identical"] else
               "**differing**: " + names(g["differs"]) + "."), "",
            *table(["fixture", "sha256 (committed)"],
                   [[f"`{k}`", f"`{v}`"] for k, v in g["files"].items()]), "",
            "Every named shard line-up of the fixtures (`golden.advert_sets`) negotiated for "
            "every recipe, plus unknown ones:", "",
            *table(["policy", "`allow_mtp`", "decisions", "routed to a drafter"],
                   [[f"`{k}`", f"`{v['allow_mtp']}`", str(v["decisions"]),
                     str(v["routed_mtp"])] for k, v in pol.items()]), "",
            ("The alpha policy routed no decision to a drafter (MTP or DSpark)"
             if alpha.get("routed_mtp") == 0 else "**The alpha policy routed a drafter**")
            + "; the beta column shows the same line-ups do route drafters when a policy "
            "allows it. The property test `tests/test_contract_capabilities.py::"
            "test_alpha_never_routes_property` (hypothesis: random requests, shard line-ups "
            "and policy names) is the general check; it is a pytest test, not part of this "
            "run: `.venv/bin/python -m pytest -q tests/test_contract_capabilities.py "
            "tests/test_contract_golden.py`.", ""]


def dspark(r: Run) -> list[str]:
    """DSpark beside MTP (`mtplib.records.ownership_dspark`)."""
    return dspark_section(r.own, r.st)


# -- tests, limitations, handoff, the rule ----------------------------------------------
#: Where DGR-065's code lives (the "Changed files" section).
FILES: tuple[tuple[str, str], ...] = (
    ("mtplib/ownership/", "the ownership derivation from GGUF headers (`derivation.py`), shard "
     "plans (`plan.py`), its tables and charts (`report.py`)"),
    ("mtplib/model/arch.py", "deepseek4 names, hyper-parameters, tensor table and the "
     "converter's dtypes (`CONVERTER_DTYPES`)"),
    ("mtplib/model/fixture.py", "the tiny trunk and sidecar fixture in upstream's layout"),
    ("mtplib/model/presets.py", "the fixture presets and the weight-less V4-Flash table"),
    ("mtplib/runtime/graph_reads.py", "what upstream's graphs read and its caches allocate "
     "(the check of criteria one and two)"),
    ("mtplib/runtime/dspark/graph_reads.py", "the same check for a DSpark draft's two graphs "
     "and its context's caches"),
    ("mtplib/contract/", "the contract of both drafters (MTP, and DSpark in `dspark.py`): "
     "typed values, session lifecycle, seam rules, wire rule, capability negotiation and "
     "golden fixtures"),
    ("mtplib/lab/contract_checks.py", "the contract checks notebook 02_state_contract runs"),
    ("mtplib/records/ownership_report.py", "this README's writer"),
    ("mtplib/records/ownership_dspark.py", "its DSpark section"),
    ("mtplib/records/pytest_results.py", "the criterion tests' results this README prints "
     "(`mtplib evidence --tests`)"),
    ("mtplib/records/raw_metrics.py", "the raw metrics files the notebooks write"),
    ("notebooks/01_tensor_ownership.py", "the source of notebook 01_tensor_ownership "
     "(jupytext percent format)"),
    ("notebooks/02_state_contract.py", "the source of notebook 02_state_contract "
     "(jupytext percent format)"),
)

#: The test files that check each criterion (the "Tests" section).
TESTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Criterion one: derived reads against upstream's graphs",
     ("tests/test_ownership.py", "tests/test_graph_reads.py",
      "tests/test_ownership_dspark.py")),
    ("Criterion two: cache bytes", ("tests/test_graph_reads.py", "tests/test_fixture.py")),
    ("Criterion three: V4-Flash at real scale", ("tests/test_v4_flash.py",)),
    ("Criterion four: contract and the alpha policy",
     ("tests/test_contract_capabilities.py", "tests/test_contract_golden.py",
      "tests/test_contract_seam.py", "tests/test_contract_session.py",
      "tests/test_contract_types.py", "tests/test_policy.py", "tests/test_policy_paths.py",
      "tests/test_contract_dspark.py")),
    ("This README", ("tests/test_evidence_dgr065.py", "tests/test_evidence_sections.py",
                     "tests/test_pytest_results.py")),
)


def changed_files(r: Run) -> list[str]:
    return changed_files_section(STORY, "mtplib.records.ownership_report.FILES", FILES)


def tests(r: Run) -> list[str]:
    return tests_section(STORY, TESTS, r.tests, r.link, (
        "`tests/test_graph_reads.py` includes negative checks (a derivation wrong by one "
        "tensor, or one leaving out the unread V cache, fails); `tests/test_v4_flash.py` "
        "asserts the derivation time limit; `tests/test_evidence_dgr065.py` runs "
        "notebooks 01_tensor_ownership and 02_state_contract on a short lane and "
        "regenerates this README from their metrics.",))


def limitations(r: Run) -> list[str]:
    """What the numbers above do not show."""
    fx = r.fx
    out = ["## Limitations", "",
           f"- The fixture is a tiny random-weight model ({fx['n_layer']} trunk layers + "
           f"{fx['n_mtp']} MTP block): it checks which tensors and caches upstream's graphs "
           "read and allocate, not anything about the real model's weights.",
           "- **V4-Flash dtypes come from the converter mapping** (`CONVERTER_DTYPES` in "
           "`mtplib/model/arch.py`, following upstream's `conversion/deepseek.py`); the "
           "published checkpoint's own dtypes were not read (no network). Upstream loading "
           "the tables with `no_alloc` confirms shapes and sizes, not that a real "
           "conversion would pick exactly these types.",
           "- **Cache bytes at real scale are formulas.** They were measured against "
           "upstream on the fixture only; at V4-Flash scale the same formulas are "
           "extrapolated: a context cannot be created on the `no_alloc` model (the "
           "scheduler aborts) and a weight-less file is refused for decoding by design. The "
           "CPU buffer alignment is assumed; a GPU buffer type may pad differently.",
           "- The derivation times were measured once, on the machine above "
           f"({r.cpu.get('logical_cores')} logical cores, possibly shared with other jobs); "
           "they are a check against the limit, not a benchmark.",
           "- `kv_unified=false` only (the C default); one MTP block only (upstream asserts "
           "`n_layer_nextn == 1`); the replicas are counted for the MTP block on the last "
           "shard (placement `tail`); with the default placement (`client`) the client "
           "process loads the sidecar and holds them instead.",
           "- The alpha-policy result above covers the fixtures' named line-ups; the general "
           "claim rests on the property test, which is not part of this run.",
           *dspark_limitations()]
    git = r.rec.get("git", {})
    if git.get("dirty"):
        out.append("- The run was made from a checkout with uncommitted changes "
                   f"(`{git.get('commit')}` plus edits).")
    return [*out, ""]


def _handoff_memory(r: Run) -> list[str]:
    rep_b = [x for x in r.tail_replicas if x["kind"] == "replica"]
    dup_b = [x for x in r.tail_replicas if x["kind"] == "duplicate"]
    holder = ("the shard holding the MTP sidecar (the tail, with placement `tail`; the "
              "client process with the default placement `client`)")
    return [f"- **Tail shard memory:** besides its layers, {holder} carries "
            + "; ".join(f"the replica `{x['name']}` ({x['bytes']} bytes)"
                                   for x in rep_b)
            + ("; " if rep_b and dup_b else "")
            + "; ".join(f"the duplicate `{x['name']}` ({x['bytes']} bytes, "
                        + ("read by MTP" if x["read_by"] else "never read") + ")"
                        for x in dup_b)
            + ". Sharing them with the trunk would need upstream support."]


def _handoff_swa(r: Run) -> list[str]:
    big = max(r.ctxs) if r.ctxs else None
    full = next((x for x in r.totals if x["n_ctx"] == big and x["swa_full"]), None)
    win = next((x for x in r.totals if x["n_ctx"] == big and not x["swa_full"]), None)
    if not (full and win):
        return []
    same_v = "an equal" if full["mtp_swa_v_unread"] == full["mtp_swa_k"] else "an"
    return [f"- **`swa_full`:** the C-API default (`true`) sizes the raw SWA cache to the "
            f"whole context: {full['raw_swa_k']} bytes at n_ctx {big} for the whole model "
            f"(cache total {full['total']}); ranged contexts should set `swa_full=false`: "
            f"{win['raw_swa_k']} bytes (total {win['total']}).",
            f"- **MTP context memory:** budget the MTP context at its K plus {same_v} unread "
            f"V (upstream allocates it): {full['mtp_swa_k']} + {full['mtp_swa_v_unread']} "
            f"bytes at n_ctx {big} with `swa_full=true`."]


def _handoff_seam(r: Run) -> list[str]:
    per = r.seam["per_seam"]
    if "f32" not in per or "bf16" not in per:
        return []
    f32, bf16 = per["f32"], per["bf16"]
    return [f"- **Seam traffic per decode token** is `decode_token` only: "
            f"{f32['decode_token']} bytes in f32 or {bf16['decode_token']} in bf16, per seam "
            "between shards, in both placements of the MTP block.",
            "- **What MTP adds, by placement** (`--mtp-placement`): with the MTP block in the "
            "client (`client`, the default) the tail's connection to the client carries "
            f"`sampler_hidden`, {f32['mtp_hidden_remote']} / {bf16['mtp_hidden_remote']} "
            "bytes (f32 / bf16) per verified position, which the client's head and the MTP "
            "block both read; drafts cost no round trip. With it on the tail shard (`tail`) "
            "no hidden row crosses for MTP (it reads `mtp_hidden` in place) and each draft "
            "costs a round trip to the tail (contract minimum `draft_step`, "
            f"{f32['draft_step']} bytes). Ranged MTP routes only where each shard's own "
            "report (contract version, pin) matches the client's "
            "(`mtplib.distributed.shard_report`)."]


def handoff(r: Run) -> list[str]:
    """What DGR-066 should build on: memory of the tail shard, swa_full, seam traffic."""
    return ["## Handoff to DGR-066", "", *_handoff_memory(r), *_handoff_swa(r),
            *_handoff_seam(r), *dspark_handoff(r.st),
            "- **Reuse:** `mtplib inventory --json` and `mtplib.ownership.derivation.derive` "
            "give each shard its layer range, files, replicas and caches; "
            "`mtplib.runtime.graph_reads.check_pair` re-checks any new fixture against "
            "upstream.", ""]


def dependency_handoff(r: Run) -> list[str]:
    """DGR-051/054/060/064 in, DGR-067/070 out (issue 15). Their texts are not here."""
    missing = "its text is not in this repository, and nothing here is attributed to it."
    return dependency_section(
        STORY, tuple((s, missing) for s in ("DGR-051", "DGR-054", "DGR-060", "DGR-064")),
        (("DGR-067", "its text is not in this repository; what it can build on is listed "
                     "in the last line."),
         ("DGR-070", "its text is not in this repository; what it can build on is listed "
                     "in the last line.")),
        "upstream llama.cpp at the pinned commit (its deepseek4 loader, graph builder and "
        "cache allocation, read through llama-cpp-python), the layout of upstream's "
        "converter for the sidecar and the V4-Flash dtypes (`conversion/deepseek.py`, "
        "followed in `mtplib/model/arch.py`), and the tiny fixture it generates itself.",
        "the ownership derivation (`mtplib inventory --json`, "
        "`mtplib.ownership.derivation.derive`), the graph-read check "
        "(`mtplib.runtime.graph_reads.check_pair`), the contract (`mtplib.contract`: typed "
        "values, seam validator, negotiation, golden fixtures in `tests/golden/contract`) "
        "and the section \"Handoff to DGR-066\" above.")


def tracing_rule(r: Run) -> list[str]:
    return ["## How numbers are traced", "", TRACE_RULE, ""]


#: The README's sections in order.
SECTIONS: tuple[Callable[[Run], list[str]], ...] = (
    header, the_run, criterion_1_reads, criterion_2_caches, criterion_3_flash,
    criterion_4_contract, dspark, changed_files, tests, limitations, handoff,
    dependency_handoff,
    tracing_rule)


def render(run_dir: Path, raw: dict, link: Links) -> str:
    """The README of the run in ``run_dir``."""
    r = Run.from_raw(run_dir, raw, link)
    return "\n".join(line for section in SECTIONS for line in section(r))


def story_files(run_dir: Path) -> list[Path]:
    """DGR-065's part of a run: notebooks 01/02, their raw metrics, the run record and
    the criterion tests' results where they were recorded."""
    return [Path(n) for n in (*NOTEBOOKS, *RAW, "run_record.json", f"tests-{STORY}.json")
            if (run_dir / n).is_file()]
