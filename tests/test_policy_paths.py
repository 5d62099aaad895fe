"""The deployment policy on the MTP paths that do not go through MTPRuntime or RangedMTP:
each refuses under alpha, naming the policy, before it loads or starts anything; and a scan
of mtplib's source finds no MTP context, MTP drafter or upstream MTP loop that is built
outside a function that asks the policy (directly, or only ever called from such one)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtplib.contract.capabilities import ALPHA_POLICY, RouteRefused
from mtplib.errors import InputError
from mtplib.runtime.routing import POLICY_ENV, require_mtp

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "mtplib"
ALPHA = "refused under policy 'alpha': alpha policy: MTP disabled"


@pytest.fixture(autouse=True)
def _no_policy_env(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if anything loads a model or starts upstream's server: a refusal
    must come first."""
    import mtplib.lab.upstream_tools as U
    import mtplib.runtime.graph_reads as G
    import mtplib.runtime.model as M

    def boom(*a, **k):
        raise AssertionError("a model was loaded / a server started before the policy")

    monkeypatch.setattr(M.Model, "__init__", boom)
    monkeypatch.setattr(U.Server, "__init__", boom)
    monkeypatch.setattr(G.LoadedModel, "__init__", boom)


def refused(what: str, k: int = 1) -> str:
    return f"^{what}: mtp.v4.draft{k} {ALPHA}"


# -- the gate -----------------------------------------------------------------------------
def test_require_mtp_names_the_path_and_the_policy(monkeypatch):
    with pytest.raises(RouteRefused, match=refused("thing", 2)) as e:
        require_mtp("thing", (2, 3), policy="alpha")
    assert isinstance(e.value, InputError)  # exit 2 on the command line
    assert require_mtp("thing", (1, 2, 3), policy="beta").name == "beta"
    assert require_mtp("thing", (), policy="alpha") is ALPHA_POLICY  # no MTP asked
    monkeypatch.setenv(POLICY_ENV, "alpha")
    with pytest.raises(RouteRefused, match=refused("thing")):
        require_mtp("thing")
    with pytest.raises(RouteRefused, match="policy 'beta': unknown recipe"):
        require_mtp("thing", (9,), policy="beta")


# -- each path under alpha ------------------------------------------------------------------
def test_side_by_side_paths_refuse_under_alpha(pair, no_models):
    from mtplib.lab.common.acceptance_sweep import SweepConfig
    from mtplib.lab.sidebyside.cases import Case, SideBySideConfig
    from mtplib.lab.sidebyside.cost import cost_ratio
    from mtplib.lab.sidebyside.measure import _MtplibSide, _UpstreamSide, run_side_by_side
    from mtplib.lab.sidebyside.sweep import acceptance_sweep

    t, s = str(pair.trunk), str(pair.sidecar)
    with pytest.raises(RouteRefused, match=refused("cost ratio")):
        cost_ratio(t, s, policy="alpha")
    cfg = SideBySideConfig(ks=(2, 3), rate_sets=((1.0,),))
    with pytest.raises(RouteRefused, match=refused("side-by-side", 2)):
        run_side_by_side(t, s, cfg, policy="alpha")
    with pytest.raises(RouteRefused, match=refused("upstream's MTP loop \\(llama-server\\)")):
        _UpstreamSide(t, s, Case(1), cfg, None, policy="alpha")
    with pytest.raises(RouteRefused, match="^mtp.v4.draft1 " + ALPHA):
        _MtplibSide(t, s, Case(1), cfg, policy="alpha")  # MTPRuntime's own gate
    with pytest.raises(RouteRefused, match=refused("acceptance sweep")):
        acceptance_sweep(t, s, SweepConfig(ks=[1], rates=[0.5]), cfg, policy="alpha")


def test_side_by_side_follows_the_environment(pair, no_models, monkeypatch):
    from mtplib.lab.sidebyside.cost import cost_ratio

    monkeypatch.setenv(POLICY_ENV, "alpha")  # a lane's notebooks name no policy
    with pytest.raises(RouteRefused, match=refused("cost ratio")):
        cost_ratio(str(pair.trunk), str(pair.sidecar))


def test_trained_eval_paths_refuse_under_alpha(pair, no_models):
    from mtplib.lab import trained_eval as E
    from mtplib.model.trained import TrainedPair

    t, s = str(pair.trunk), str(pair.sidecar)
    with pytest.raises(RouteRefused, match=refused("upstream_mtp")):
        E.upstream_mtp(s, [1, 2, 3], None, policy="alpha")
    with pytest.raises(RouteRefused, match=refused("next_token_accuracy with a sidecar")):
        E.next_token_accuracy(t, [[1, 2, 3]], sidecar=s, policy="alpha")
    with pytest.raises(RouteRefused, match=refused("acceptance", 1)):
        E.acceptance(t, s, [[1, 2, 3]], ks=(1, 2), policy="alpha")
    with pytest.raises(RouteRefused, match=refused("speed", 1)):
        E.speed(t, s, [[1, 2, 3]], ks=(0, 1), policy="alpha")
    with pytest.raises(RouteRefused, match=refused("check_parity")):
        E.check_parity(TrainedPair(Path(t), Path(s), Path("none.npz")), policy="alpha")
    with pytest.raises(RouteRefused, match=refused("trained_eval")):
        E.measure_all(REPO / "nowhere", policy="alpha")


def test_trained_eval_plain_trunk_runs_under_alpha(pair):
    """Without a sidecar next_token_accuracy runs the trunk alone: not an MTP path."""
    from mtplib.lab import trained_eval as E

    out = E.next_token_accuracy(str(pair.trunk), [list(range(1, 12))], window=8,
                                n_threads=1, policy="alpha")
    assert out["tokens"] == 10 and "mtp_tokens" not in out


def test_trained_eval_main_is_one_line_exit_2(capsys):
    from mtplib.lab import trained_eval as E
    from mtplib.model.trained import trained_paths

    if not trained_paths().exists():
        pytest.skip("the trained pair is not committed here")
    assert E.main(["--parity-only", "--policy", "alpha"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("python -m mtplib.lab.trained_eval: error: trained_eval: "
                          f"mtp.v4.draft1 {ALPHA}")


def test_graph_check_refuses_the_mtp_graph_under_alpha(pair, no_models):
    from mtplib.ownership.derivation import CacheParams, inventory_from_paths
    from mtplib.runtime import graph_reads as G

    with pytest.raises(RouteRefused, match=refused("the MTP graph check")):
        G.observe(str(pair.sidecar), CacheParams(n_ctx=256), graph="mtp", policy="alpha")
    inv = inventory_from_paths(pair.trunk, pair.sidecar)
    with pytest.raises(RouteRefused, match=refused(r"check_pair \(the MTP graph\)")):
        G.check_pair(inv, CacheParams(n_ctx=256), policy="alpha")


def test_graph_check_main_graph_runs_under_alpha(pair):
    from mtplib.ownership.derivation import CacheParams
    from mtplib.runtime import graph_reads as G

    obs = G.observe(str(pair.trunk), CacheParams(n_ctx=256), graph="main", policy="alpha",
                    n_threads=1)
    assert obs.weights  # the trunk's graph is plain decoding


def test_mtp_llama_refuses_under_alpha(pair, monkeypatch):
    pytest.importorskip("llama_cpp")
    import mtplib.llama.build as build

    def boom(*a, **k):
        raise AssertionError("the MTPDraftModel was built before the policy")

    monkeypatch.setattr(build, "MTPDraftModel", boom)
    with pytest.raises(RouteRefused, match=refused("mtp_llama", 2)):
        build.mtp_llama(str(pair.trunk), str(pair.sidecar), 2, policy="alpha")
    monkeypatch.setenv(POLICY_ENV, "alpha")
    with pytest.raises(RouteRefused, match=refused("mtp_llama", 3)):
        build.mtp_llama(str(pair.trunk), str(pair.sidecar))


def test_ranged_mtp_context_refuses_under_alpha():
    """The raw ranged API: an MTP context on the shards is refused before any request
    (the object needs no shards for that: nothing is sent)."""
    from mtplib.distributed.client import RangedRuntime

    rt = object.__new__(RangedRuntime)
    rt.sidecar, rt.endpoints = {"placement": {}}, ["127.0.0.1:1", "127.0.0.1:2"]
    rt._request = lambda *a, **k: pytest.fail("a request was sent")
    with pytest.raises(RouteRefused, match=refused("an MTP context on the shards")):
        rt.context(mtp=True, policy="alpha")


def test_advertise_under_alpha_never_probes_an_mtp_context(pair, tmp_path, monkeypatch):
    import mtplib.runtime.capability as C

    monkeypatch.setattr(C, "_probe_mtp_context",
                        lambda *_: pytest.fail("an MTP context was probed under alpha"))
    C.advertise(pair.trunk, pair.sidecar, cert_dir=tmp_path, policy="alpha")


def test_compare_upstream_cli_refuses_under_alpha_before_the_build(pair, tmp_path):
    """Exit 2 with one line naming the policy, for every mode that runs MTP, before the
    9-minute build of upstream's tools (an empty cache would start it)."""
    env = {**os.environ, "MTPLIB_CACHE_DIR": str(tmp_path / "cache"), POLICY_ENV: "alpha"}
    base = [sys.executable, "-m", "mtplib.cli", "compare-upstream", "--model",
            str(pair.trunk), "--mtp", str(pair.sidecar), "--quiet"]
    for extra in ([], ["--cost-ratio-only"], ["--sweep", "0.5", "--k", "2"],
                  ["--k", "0", "--cost-ratio"]):
        r = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120,
                           cwd=REPO, env=env)
        assert r.returncode == 2, (extra, r.stderr)
        assert "compare-upstream: mtp.v4.draft" in r.stderr and ALPHA in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()  # nothing was built


# -- the scan: no MTP context outside a routed entry point ------------------------------------
GATES = {"route", "require_mtp", "require_route", "negotiate", "policy_gate",
         "check_policy", "require_shard_mtp"}
"""A call to one of these in a function's body asks the policy (``x.allow_mtp`` too;
``check_policy``: the verdict a run's request got from policy_gate, applied to one
generation's drafting)."""

ALLOWED = {
    ("distributed/worker.py", "_handle"):
        "the worker process executes its client's requests: the client asked the policy "
        "(RangedRuntime.context, RangedMTP.generate before build_engine runs there)",
    ("reports/side_by_side/c_decode.py", "python_one"):
        "a plain decode benchmark: its config is `setup()`'s dict of literals, which holds "
        "no mtp key",
    ("runtime/generate.py", "run_greedy"):
        "loads the trunk without load_mtp, and Context refuses an MTP config on such a "
        "model (mtplib.runtime.model.Context): it cannot build an MTP context",
}
"""Functions that build an MTP context without asking the policy themselves and without
a routed caller in mtplib, and why that is right. Keep it short: a new entry needs a
reason a reviewer can check."""


def _name(f: ast.AST) -> str | None:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
        else None


def _sites(fn: ast.AST) -> list[str]:
    """What in ``fn``'s body builds an MTP context, an MTP drafter or upstream's loop. A
    config made from data (``ContextConfig(**x)``) counts where the same function builds a
    Context: the data may ask for MTP."""
    out = []
    builds = any(isinstance(n, ast.Call) and _name(n.func) == "Context" for n in ast.walk(fn))
    for node in ast.walk(fn):
        if isinstance(node, ast.Constant) and node.value == "draft-mtp":
            out.append("upstream's MTP loop (--spec-type draft-mtp)")
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in ("MTPDrafter", "MTPDraftModel"):
            out.append(f"{name}(...)")
        if name not in ("ContextConfig", "from_settings", "replace"):
            continue
        for kw in node.keywords:
            if kw.arg == "mtp" and not (isinstance(kw.value, ast.Constant)
                                        and kw.value.value is False):
                out.append(f"{name}(mtp=...)")
            elif kw.arg is None and name == "ContextConfig":
                d = kw.value
                if isinstance(d, ast.Dict) and any(
                        isinstance(k, ast.Constant) and k.value == "mtp" for k in d.keys):
                    out.append("ContextConfig(**{'mtp': ...})")
                elif builds and not (isinstance(d, ast.Dict) and None not in d.keys):
                    out.append("Context(ContextConfig(**data)) (may be an MTP context)")
    return out


def _gated(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and _name(node.func) in GATES:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "allow_mtp":
            return True
    return False


def _functions(root: Path, sources: dict[str, str] | None = None) -> list[dict]:
    """Every module-level function and method (nested ones belong to their outer one)."""
    out = []
    files = sources or {str(p.relative_to(root)): p.read_text()
                        for p in sorted(root.rglob("*.py"))}
    for rel, text in files.items():
        tree = ast.parse(text)
        # names this module may refer to by their bare name: its own and what it imports
        local = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        local |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  for a in n.names}
        for node in tree.body:
            defs = [(node, None)] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                else [(n, node.name) for n in node.body
                      if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)] \
                if isinstance(node, ast.ClassDef) else []
            for fn, cls in defs:
                # how callers name it: the class for a constructor, else its own name
                called = cls if fn.name == "__init__" and cls else fn.name
                out.append({"file": rel, "name": fn.name if not cls else f"{cls}.{fn.name}",
                            "short": fn.name, "called": called, "method": called != cls
                            and cls is not None, "node": fn, "local": local,
                            "sites": _sites(fn), "gated": _gated(fn)})
    return out


def _refs(fn: ast.AST) -> tuple[set[str], set[str]]:
    """(bare names ``fn`` uses: ``f(...)``, ``g(f)``; attributes it calls: ``x.f(...)``)."""
    names, attrs = set(), set()
    notes = [n.returns for n in ast.walk(fn) if isinstance(n, ast.FunctionDef)] + \
        [n.annotation for n in ast.walk(fn) if isinstance(n, ast.arg | ast.AnnAssign)]
    skip = {id(x) for a in notes if a is not None for x in ast.walk(a)}  # type hints
    for node in ast.walk(fn):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attrs.add(node.func.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names, attrs


def _calls(c: dict, f: dict, refs: tuple[set[str], set[str]]) -> bool:
    """Whether ``c`` may call ``f``: ``x.f(...)`` anywhere (a method, or a function through
    its module); a bare name only where ``c``'s module defines or imports it."""
    names, attrs = refs
    n = f["called"]
    return n in attrs or (not f["method"] and n in names and n in c["local"])


def ungated_mtp_sites(root: Path = PKG, sources: dict[str, str] | None = None,
                      allowed: dict | None = None) -> list[str]:
    """Functions that build an MTP context and are not routed: neither asking the policy
    themselves nor called only from functions that are (transitively). Name-based, so a
    same-named caller anywhere counts as a caller: that only makes the scan stricter."""
    allowed = ALLOWED if allowed is None else allowed
    fns = _functions(root, sources)
    refs = {id(f): _refs(f["node"]) for f in fns}

    def ok(f: dict, seen: frozenset) -> bool:
        if f["gated"] or (f["file"], f["short"]) in allowed:
            return True
        callers = [c for c in fns if c is not f and _calls(c, f, refs[id(c)])]
        if not callers or id(f) in seen:
            return False
        return all(ok(c, seen | {id(f)}) for c in callers)

    return [f"{f['file']}:{f['name']}: {', '.join(f['sites'])}" for f in fns
            if f["sites"] and not ok(f, frozenset())]


def test_no_mtp_context_outside_a_routed_entry_point():
    assert ungated_mtp_sites() == []


def test_the_scan_sees_every_known_mtp_site():
    """Not vacuous: the scan finds the MTP sites this repository has, and every allowed
    entry is still one (a stale entry must go)."""
    found = {(f["file"], f["short"]) for f in _functions(PKG) if f["sites"]}
    for want in [("lab/sidebyside/cost.py", "cost_ratio"),
                 ("lab/trained_eval.py", "upstream_mtp"),
                 ("lab/trained_eval.py", "next_token_accuracy"),
                 ("runtime/graph_reads.py", "observe"), ("runtime/speculative.py",
                                                         "build_engine"),
                 ("runtime/capability.py", "_probe_mtp_context"), ("llama/draft.py", "attach"),
                 ("distributed/client.py", "context"), ("lab/upstream_tools.py", "spec_args")]:
        assert want in found, want
    for file, name in ALLOWED:
        assert (file, name) in found, (file, name)


def test_the_scan_catches_a_new_unrouted_path():
    new = {
        "a.py": "def new_path(m):\n    return Context(m, ContextConfig(n_ctx=8, mtp=True))\n",
        "b.py": "def helper(m):\n    return MTPDrafter(m)\n\n"
                "def entry(m):\n    return helper(m)\n\n"
                "def routed(m):\n    require_mtp('x')\n    return helper(m)\n",
        "c.py": "def data(m, msg):\n    return Context(m, ContextConfig(**msg))\n\n"
                "def fine(m, msg):\n    route(1)\n    return Context(m, ContextConfig(**msg))\n\n"
                "def convert(msg):\n    return ContextConfig(**msg)\n\n"
                "def plain():\n    return ContextConfig(n_ctx=8, mtp=False)\n",
        "d.py": "class R:\n    def context(self, cfg):\n"
                "        return ContextConfig(**{**cfg, 'mtp': True})\n",
    }
    assert ungated_mtp_sites(sources=new, allowed={}) == [
        "a.py:new_path: ContextConfig(mtp=...)", "b.py:helper: MTPDrafter(...)",
        "c.py:data: Context(ContextConfig(**data)) (may be an MTP context)",
        "d.py:R.context: ContextConfig(**{'mtp': ...})"]
    assert ungated_mtp_sites(sources={"b.py": new["b.py"].split("def entry")[0]
                                      + "def routed(m):\n    route(1)\n    return helper(m)\n"},
                             allowed={}) == []


def test_notebooks_name_no_policy_of_their_own():
    """The notebooks reach MTP only through mtplib's routed paths (their kernels inherit
    the lane's $MTPLIB_POLICY): no notebook cell builds an MTP context itself."""
    seen = 0
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        for c in json.loads(nb.read_text())["cells"]:
            if c["cell_type"] != "code":
                continue
            code = "\n".join(x for x in "".join(c["source"]).splitlines()
                             if not x.lstrip().startswith(("%", "!")))
            assert _sites(ast.parse(code)) == [], nb.name
            seen += 1
    assert seen
