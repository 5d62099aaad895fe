"""`mtplib run`: execute a lane's notebooks with papermill into outputs/<run-id>/.

A lane is one YAML file in params/. The pipeline prepares the models (generating the
built-in fixture when the lane asks for it), injects their paths into every notebook's
`parameters` cell, and writes a run record next to the executed notebooks.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from mtplib import envs, paths
from mtplib.errors import InputError, MtplibError
from mtplib.files import make_dirs, remove_dirs, safe_component
from mtplib.lab.common.checks import MAX_THREADS, Context, ParameterError
from mtplib.records import parameters as NP
from mtplib.records.jupyter import KERNEL, papermill_options  # KERNEL: what lanes run on
from mtplib.records.raw_metrics import read_seam_bytes
from mtplib.records.run_record import base_record, end_record, file_hashes, write_json
from mtplib.stamps import now_iso, run_stamp

if TYPE_CHECKING:
    from mtplib.lab.bench.config import BenchConfig

REPO = paths.REPO
NOTEBOOKS = REPO / "notebooks"


class LaneError(InputError):
    """A params file that is malformed or asks for what this machine lacks."""


class LaneFailed(MtplibError):
    """A lane's notebook raised: the message names it and where its partial output is."""


@dataclass
class Lane:
    name: str
    path: Path
    notebooks: list[dict]
    fixture: dict | None = None
    models: dict | None = None
    threads: int = 2
    parameters: dict = field(default_factory=dict)
    description: str = ""
    bench: dict | None = None  # the `bench:` section (mtplib.lab.bench.config.BenchConfig)
    evidence: list[str] = field(default_factory=list)  # stories whose README a run writes
    wan: dict | None = None  # the `wan:` section (mtplib.lab.wan.config.WanConfig)
    #: `policy:` alpha | beta, for the bench and every notebook's MTP runs (None:
    #: $MTPLIB_POLICY, else beta); under alpha a lane with a bench stops before anything runs
    policy: str | None = None
    requires: dict | None = None  # hardware: {gpus: N, gpu_memory_gb: G, hardware: "text"}


REQUIRES_KEYS = {"gpus", "gpu_memory_gb", "hardware"}
#: `requires:` beyond these is a typo: no host a lane runs on has more local GPUs, nor a
#: GPU more memory (GB)
MAX_GPUS = 64
MAX_GPU_MEMORY_GB = 1024


def _requires(p: Path, req: object) -> dict | None:
    """The lane's `requires:` section: how many local GPUs, how much memory each (GB,
    decimal, as the device reports total memory) and a sentence naming the hardware."""
    if req is None:
        return None
    if not isinstance(req, dict) or set(req) - REQUIRES_KEYS or "hardware" not in req:
        raise LaneError(f"{p}: 'requires' must be a mapping with 'hardware' (a sentence) and "
                        f"optionally 'gpus' and 'gpu_memory_gb'; known keys "
                        f"{sorted(REQUIRES_KEYS)}, got {req!r}")
    gpus, mem = req.get("gpus", 0), req.get("gpu_memory_gb", 0)
    if not _is_int(gpus) or not 0 <= gpus <= MAX_GPUS:
        raise _bad(p, "requires.gpus", f"an int 0..{MAX_GPUS}", gpus)
    if isinstance(mem, bool) or not isinstance(mem, int | float) \
            or not 0 <= mem <= MAX_GPU_MEMORY_GB:
        raise _bad(p, "requires.gpu_memory_gb", f"a number 0..{MAX_GPU_MEMORY_GB} (GB)", mem)
    return {"gpus": gpus, "gpu_memory_gb": float(mem), "hardware": str(req["hardware"])}


TOP_KEYS = {"lane", "description", "notebooks", "fixture", "models", "threads", "parameters",
            "bench", "evidence", "wan", "policy", "requires"}
FIXTURE_KEYS = {"preset", "seed"}
MODELS_KEYS = {"trunk", "sidecar", "storage_root"}
NOTEBOOK_KEYS = {"notebook", "parameters"}
#: parameters the runner itself injects into every notebook (models, threads, run folder,
#: the lane's bench/wan sections): a lane never has to declare them
INJECTED = {"trunk", "sidecar", "threads", "run_dir", "bench", "wan"}


#: a lane's `threads` beyond this is a typo on any machine (upstream's thread pool crashed
#: at 100000); the machine's own CPU count is checked by `check_lane_requirements`
MAX_LANE_THREADS = MAX_THREADS


def _bad(p: Path, key: str, expected: str, got: object) -> LaneError:
    """The one-line schema error: file, key path, what is expected, what was found."""
    return LaneError(f"{p}: {key}: expected {expected}, got {got!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mapping(p: Path, key: str, v: object, known: set[str] | None = None,
             required: tuple[str, ...] = ()) -> dict:
    if not isinstance(v, dict):
        raise _bad(p, key, "a mapping" + (f" with keys {sorted(known)}" if known else ""), v)
    bad_keys = [k for k in v if not isinstance(k, str)]
    if bad_keys:
        raise _bad(p, key, "string keys", bad_keys[0])
    if known is not None and set(v) - known:
        raise LaneError(f"{p}: {key}: unknown keys {sorted(set(v) - known)} "
                        f"(known: {sorted(known)})")
    for r in required:
        if r not in v:
            raise LaneError(f"{p}: {key}.{r}: missing (required)")
    return v


def _notebook_path(p: Path, key: str, name: object) -> str:
    """A notebook entry names a file directly inside notebooks/ (no path escape)."""
    if not isinstance(name, str) or not name:
        raise _bad(p, key, "a notebook file name in notebooks/ (e.g. 00_fixture_smoke.ipynb)",
                   name)
    if "/" in name or "\\" in name or name in (".", "..") or not name.endswith(".ipynb"):
        raise _bad(p, key, "a .ipynb file name directly inside notebooks/ (no path)", name)
    nb = NOTEBOOKS / name
    if nb.resolve().parent != NOTEBOOKS.resolve():
        raise _bad(p, key, "a notebook inside notebooks/", name)
    if not nb.exists():
        raise LaneError(f"{p}: {key}: notebook {name} not found in {NOTEBOOKS}")
    return name


def declared_parameters(name: str) -> dict[str, object]:
    """The notebook's `parameters` cell: name -> default value (`...` where the default is
    an expression rather than a literal, so its type is unknown)."""
    import ast

    import papermill as pm

    out: dict[str, object] = {}
    for k, info in pm.inspect_notebook(str(NOTEBOOKS / name)).items():
        try:
            out[k] = ast.literal_eval(str(info.get("default")))
        except (ValueError, SyntaxError):
            out[k] = ...
    return out


def _type_ok(value: object, default: object) -> tuple[bool, str]:
    """Does ``value`` fit the type of the notebook's default? Returns (ok, expected). For a
    parameter `mtplib.records.parameters` has no rule for (a notebook of one's own)."""
    if default is None or default is ...:
        return True, "any value"
    if isinstance(default, bool):
        return isinstance(value, bool), "a bool"
    if _is_int(default):
        return _is_int(value), "an int"
    if isinstance(default, float):
        return (_is_int(value) or isinstance(value, float)), "a number"
    if isinstance(default, str):
        return isinstance(value, str), "a string"
    if isinstance(default, list | tuple):
        return isinstance(value, list), "a list"
    if isinstance(default, dict):
        return isinstance(value, dict), "a mapping"
    return True, "any value"


def _check_value(p: Path, name: str, value: object, where: str, default: object,
                 nb: str, ctx: Context) -> None:
    """One lane value for the notebook parameter ``name``: the notebooks' own rule
    (`mtplib.records.parameters`), else the type of the notebook's default."""
    if name in NP.PARAMETERS:
        try:
            NP.check_value(name, value, where=where, ctx=ctx)
        except ParameterError as e:
            raise LaneError(f"{p}: {e}") from None
        return
    ok, want = _type_ok(value, default)
    if not ok:
        raise _bad(p, where, f"{want} (the default in {nb} is {default!r})", value)


def _check_parameters(p: Path, notebooks: list[dict], lane_params: dict,
                      ctx: Context) -> None:
    """Every lane parameter is declared by the notebook(s) it goes to and passes the rule
    the notebook checks it with: a typo (`n_token: 8`) or a bad value (`ks: 3`) stops the
    lane before anything runs, naming its key path."""
    declared = {item["notebook"]: declared_parameters(item["notebook"]) for item in notebooks}

    def ctx_of(decl: dict) -> Context:  # the lane's models bound plans where they are used
        return ctx if "trunk" in decl else Context()  # 05 reads the trained pair instead

    for i, item in enumerate(notebooks):
        name, decl = item["notebook"], declared[item["notebook"]]
        for k, v in (item.get("parameters") or {}).items():
            if k not in decl and k not in INJECTED:
                raise LaneError(f"{p}: notebooks[{i}].parameters.{k}: {name} declares no "
                                f"parameter {k!r} (declared: {', '.join(sorted(decl))})")
            _check_value(p, k, v, f"notebooks[{i}].parameters.{k}", decl.get(k), name,
                         ctx_of(decl))
    for k, v in lane_params.items():
        takers = [n for n, d in declared.items() if k in d]
        if not takers and k not in INJECTED:
            raise LaneError(f"{p}: parameters.{k}: no notebook of the lane declares {k!r} "
                            "(declared: " + "; ".join(f"{n}: {', '.join(sorted(d))}"
                                                      for n, d in declared.items()) + ")")
        for n in takers:
            _check_value(p, k, v, f"parameters.{k}", declared[n][k], n, ctx_of(declared[n]))


def _model_context(fixture: dict | None) -> Context:
    """What bounds the lane's values where its models are known before they exist (a
    generated fixture preset): shard plans cover exactly its layers, a context is at most
    its context_length, a token id below its vocabulary."""
    if not fixture or fixture.get("preset", "tiny") == "trained":
        return Context()
    from mtplib.model.presets import PRESETS

    cfg = PRESETS.get(fixture.get("preset", "tiny"))
    return Context(n_layer=getattr(cfg, "n_layer", None),
                   n_ctx_train=getattr(cfg, "n_ctx_train", None),
                   n_vocab=getattr(cfg, "n_vocab", None))


def load_lane(path: str | Path) -> Lane:
    """Read and validate a lane file: every key and nested value is checked here, so a
    malformed lane stops with one line before any folder is made or notebook runs."""
    p = Path(path)
    if not p.exists():
        raise LaneError(f"params file not found: {p} (lanes live in params/*.yaml)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise LaneError(f"{p}: not valid YAML ({' '.join(str(e).split())})") from e
    if not isinstance(data, dict):
        raise LaneError(f"{p}: expected a mapping at the top level")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise LaneError(f"{p}: unknown keys {sorted(map(str, unknown))} "
                        f"(known: {sorted(TOP_KEYS)})")
    for key in ("lane", "description"):
        if key in data and not isinstance(data[key], str):
            raise _bad(p, key, "a string", data[key])
    nbs = data.get("notebooks")
    if not isinstance(nbs, list) or not nbs:
        raise _bad(p, "notebooks", "a non-empty list of notebooks (names or "
                   "{notebook: NAME, parameters: {...}})", nbs)
    norm = []
    for i, item in enumerate(nbs):
        key = f"notebooks[{i}]"
        if isinstance(item, str):
            item = {"notebook": item}
        elif isinstance(item, dict):
            item = dict(_mapping(p, key, item, NOTEBOOK_KEYS, required=("notebook",)))
        else:
            raise _bad(p, key, "a notebook name or {notebook: NAME, parameters: {...}}", item)
        item["notebook"] = _notebook_path(p, f"{key}.notebook", item["notebook"])
        if item.get("parameters") is not None:
            _mapping(p, f"{key}.parameters", item["parameters"])
        norm.append(item)
    fixture, models = data.get("fixture"), data.get("models")
    if (fixture is None) == (models is None):
        raise LaneError(f"{p}: give exactly one of 'fixture' (generated) or 'models' (files)")
    if fixture is not None:
        from mtplib.model.presets import PRESETS

        _mapping(p, "fixture", fixture, FIXTURE_KEYS)
        presets = {*PRESETS, "trained"}
        if "preset" in fixture and fixture["preset"] not in presets:
            raise _bad(p, "fixture.preset", f"one of {sorted(presets)}", fixture["preset"])
        if "seed" in fixture and (not _is_int(fixture["seed"])
                                  or not 0 <= fixture["seed"] <= NP.MAX_SEED):
            raise _bad(p, "fixture.seed", f"an int 0..{NP.MAX_SEED}", fixture["seed"])
    if models is not None:
        _mapping(p, "models", models, MODELS_KEYS, required=("trunk", "sidecar"))
        for k, v in models.items():
            if not isinstance(v, str) or not v:
                raise _bad(p, f"models.{k}", "a file name (string)", v)
    threads = data.get("threads", 2)
    if not _is_int(threads) or not 1 <= threads <= MAX_LANE_THREADS:
        raise _bad(p, "threads", f"an int >= 1 and <= {MAX_LANE_THREADS}", threads)
    params = data.get("parameters")
    params = {} if params is None else _mapping(p, "parameters", params)
    ctx = _model_context(fixture)
    for key in ("bench", "wan"):  # every key of the sections, as 04 and 05 check them
        if data.get(key) is not None:
            try:  # 05 runs on the trained pair whatever the lane's models: no n_layer
                NP.check_value(key, data[key], where=key,
                               ctx=ctx if key == "bench" else Context())
            except ParameterError as e:
                raise LaneError(f"{p}: {e}") from None
    evidence = data.get("evidence")
    if evidence is not None and (not isinstance(evidence, list)
                                 or not all(isinstance(s, str) for s in evidence)):
        raise _bad(p, "evidence", "a list of story names (e.g. [DGR-065])", evidence)
    policy = data.get("policy")
    if policy is not None:
        from mtplib.contract.capabilities import policy_named

        try:
            policy_named(policy)
        except InputError as e:
            raise LaneError(f"{p}: {e}") from None
    _check_parameters(p, norm, params, ctx)
    return Lane(name=str(data.get("lane", p.stem)), path=p, notebooks=norm,
                fixture=fixture, models=models, threads=threads, parameters=params,
                description=str(data.get("description", "")), bench=data.get("bench"),
                wan=data.get("wan"), evidence=list(evidence or []), policy=policy,
                requires=_requires(p, data.get("requires")))


def _storage_root(models: dict) -> Path:
    root = models.get("storage_root") or envs.model_root()
    if not root:
        raise LaneError("this lane needs real model files: set models.storage_root in the "
                        "params file or MTPLIB_MODEL_ROOT to the mounted storage")
    return Path(root)


def resolve_models(lane: Lane, run_dir: Path) -> dict:
    """Paths of the trunk and sidecar the notebooks use, generating the fixture if asked."""
    if lane.fixture and lane.fixture.get("preset") == "trained":
        from mtplib.model.fixture import trained_pair

        pair = trained_pair()  # committed, read in place: never written to
        if pair is None:
            raise LaneError("fixture preset 'trained' needs evidence/trained-v4/ (the committed "
                            "trained pair) in this checkout")
        return {"trunk": str(pair.trunk), "sidecar": str(pair.sidecar)}
    if lane.fixture:
        from mtplib.model.fixture import write_fixture

        pair = write_fixture(run_dir / "models", seed=int(lane.fixture.get("seed", 0)),
                             preset=str(lane.fixture.get("preset", "tiny")))
        return {"trunk": str(pair.trunk), "sidecar": str(pair.sidecar)}
    root = _storage_root(lane.models)
    out = {}
    for key in ("trunk", "sidecar"):
        p = (root / lane.models[key]).resolve()
        if str(p).startswith("/home/") or str(root.resolve()).startswith("/home/"):
            raise LaneError(f"refusing model path under /home: {p} (use mounted storage)")
        if not p.exists():
            raise LaneError(f"lane {lane.name}: {key} not found at {p}; this machine lacks "
                            "the real model, so the lane stops here")
        out[key] = str(p)
    return out


def check_lane_requirements(lane: Lane) -> BenchConfig | None:
    """Stop before anything runs when the lane's bench section is malformed or needs what
    this machine lacks (e.g. a GPU build, more threads than CPUs); and when it asks for an
    unknown evidence story. Returns the bench section as checked (None without one), for
    a caller that runs it (`mtplib bench`) not to check it again."""
    if lane.evidence:
        from mtplib.records.evidence import WRITERS

        unknown = [s for s in lane.evidence if s not in WRITERS]
        if unknown:
            raise LaneError(f"lane {lane.name}: no evidence README writer for {unknown} "
                            f"(known: {sorted(WRITERS)})")
    if lane.wan is not None:
        from mtplib.lab.wan.config import WanConfig

        try:
            WanConfig.from_dict(lane.wan)
        except (InputError, TypeError, ValueError) as e:
            raise LaneError(f"{lane.path}: {e}") from None
    needs = f" (lane needs: {lane.requires['hardware']})" if lane.requires else ""
    bench = None
    if lane.bench is not None:
        from mtplib.lab.bench.config import BenchConfig, MissingCapability, check_requirements

        try:
            bench = BenchConfig.from_dict(lane.bench, threads=lane.threads,
                                          policy=lane.policy)
            check_requirements(bench)
        except MissingCapability as e:
            raise LaneError(f"lane {lane.name}: {e}{needs}") from None
        except (ValueError, TypeError) as e:
            raise LaneError(f"{lane.path}: {e}") from None
    if lane.requires and lane.requires["gpus"]:
        from mtplib.runtime.devices import gpu_devices

        check_gpus(lane, gpu_devices())
    from mtplib.runtime.model import max_threads

    if lane.threads > max_threads():  # every context and shard would refuse it mid-run
        raise LaneError(f"{lane.path}: threads: {lane.threads} exceeds this machine's "
                        f"{max_threads()} CPUs{needs}; lower it (or run the lane where it fits)")
    return bench


def check_gpus(lane: Lane, gpus: list[dict]) -> None:
    """Stop unless ``gpus`` (local GPU devices, with memory_total) has as many devices as
    the lane's `requires.gpus` with at least `requires.gpu_memory_gb` each."""
    req = lane.requires or {}
    want, gb = req.get("gpus", 0), req.get("gpu_memory_gb", 0.0)
    big = [d for d in gpus if d.get("memory_total", 0) >= gb * 1e9]
    if len(big) < want:
        have = ", ".join(f"{d['name']} ({d.get('memory_total', 0) / 1e9:.0f} GB)"
                         for d in gpus) or "none"
        raise LaneError(f"lane {lane.name} needs {want} local GPU(s) with >= {gb:g} GB each "
                        f"({req.get('hardware', '')}); this machine has: {have}; the lane "
                        "stops here")


def _backend() -> dict:
    from mtplib.runtime.devices import backend_info

    return backend_info()


def _merge_seam_bytes(run_dir: Path, record: dict) -> None:
    """Notebooks that ran on shards leave seam_bytes.json: the run record carries it."""
    rows = read_seam_bytes(run_dir)
    if rows is not None:
        record["seam_bytes"] = rows


def kernel_env() -> dict[str, str]:
    """The environment under which papermill finds *this* interpreter's ``mtplib`` kernel.

    The venv's kernelspec (``<prefix>/share/jupyter/kernels``) comes after the user's on
    Jupyter's search path, so another checkout's ``mtplib`` (or ``python3``) kernel could win
    and import its own mtplib: put ours first, then check the spec found is ours."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_core.paths import jupyter_path

    ours = str(Path(sys.prefix) / "share" / "jupyter")
    path = [ours] + [d for d in envs.jupyter_path() if d != ours]
    # the kernel directories papermill searches under that JUPYTER_PATH: ours first
    mine = str(Path(ours) / "kernels")
    dirs = [mine] + [d for d in jupyter_path("kernels") if d != mine]
    try:
        spec = KernelSpecManager(kernel_dirs=dirs).get_kernel_spec(KERNEL)
    except NoSuchKernel:
        raise LaneError(f"no '{KERNEL}' Jupyter kernel in {ours}: run ./dev.sh setup "
                        "(it installs the kernel for this venv)") from None
    exe = Path(spec.argv[0])
    if not (exe.exists() and exe.parent.resolve() == Path(sys.executable).parent.resolve()):
        raise LaneError(f"the '{KERNEL}' kernel ({spec.resource_dir}) runs {exe}, not this "
                        f"interpreter {sys.executable}: run ./dev.sh setup")
    return {"JUPYTER_PATH": os.pathsep.join(path)}


def new_run_id(lane: str) -> str:
    return run_stamp() + "-" + re.sub(r"[^\w.-]", "_", lane)


RECORD = "run_record.json"


def claim_run_dir(run_dir: Path, *, unique: bool = False, what: str = "--run-id"
                  ) -> tuple[Path, list[Path]]:
    """Make ``run_dir`` this run's own, atomically: ``mkdir`` (never ``exist_ok``) and an
    exclusive create of its run record, so of two runs started at once only one gets a
    folder. ``unique`` (a generated name): on a collision try ``NAME-2``, ``NAME-3``, ...;
    otherwise an existing folder is refused unless it is empty (and no other run claims
    it first), and a symbolic link always (even to an empty folder: the run would write
    outside the output root). Returns (the folder, the folders created) for
    `discard_run_dir`."""
    try:
        made = make_dirs(run_dir.parent)
    except OSError as e:
        raise LaneError(f"cannot create the output folder {run_dir.parent}: "
                        f"{e.strerror or e}") from None
    names = [run_dir] + ([run_dir.with_name(f"{run_dir.name}-{i}") for i in range(2, 1000)]
                         if unique else [])
    def refuse(msg: str) -> LaneError:  # nothing of this claim is left behind
        remove_dirs(made)
        return LaneError(msg)

    for d in names:
        try:
            d.mkdir()
            made.append(d)
        except FileExistsError:
            if unique:
                continue
            if d.is_symlink():  # its files would land wherever it points, outside --out
                raise refuse(f"{d} is a symbolic link (to {os.readlink(d)}); a run folder "
                             f"must be a real folder inside its output root: pick another "
                             f"{what}") from None
            if not d.is_dir():
                raise refuse(f"{d} already exists and is not a folder; pick another "
                             f"{what}") from None
            if any(d.iterdir()):
                raise refuse(f"{d} already exists and is not empty; pick another "
                             f"{what}") from None
        except OSError as e:
            raise refuse(f"cannot create the run folder {d}: {e.strerror or e}") from None
        try:  # the claim: of two runs that found one empty folder, one makes the record
            with open(d / RECORD, "x"):
                pass
        except FileExistsError:
            if unique and d not in made:
                continue
            raise refuse(f"{d} was just claimed by another run; pick another {what}") from None
        except OSError as e:
            raise refuse(f"cannot write in the run folder {d}: {e.strerror or e}") from None
        return d, made
    raise refuse(f"every run folder name from {names[0]} to {names[-1]} is taken; pick "
                 f"another {what}")


def discard_run_dir(run_dir: Path, made: list[Path]) -> None:
    """Undo `claim_run_dir` after a failure before any notebook ran: remove what this run
    wrote (the whole folder when it made it; else the folder's content, which was empty),
    then the parent folders it made, so nothing is left that looks like a run."""
    if run_dir in made:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        for p in list(run_dir.iterdir()) if run_dir.is_dir() else []:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
    remove_dirs([m for m in made if m != run_dir])


def open_run(lane: Lane, run_dir: Path, *, argv: list[str] | None = None,
             what: str = "--run-id", unique: bool = False) -> tuple[dict, dict]:
    """Claim the run folder (`claim_run_dir`: atomic, refusing a non-empty one; with
    ``unique`` a taken generated name gets a suffix), write its first run record (status
    "running"), resolve the lane's models (generating fixtures into the folder). Returns
    (record, models); ``record["run_dir"]`` is the folder. The caller updates the record
    and writes it again with `write_json`. Any failure here (a refusal, a full or
    read-only disk) removes what was created. The one run-record setup of lanes
    (`run_lane`) and `mtplib bench`."""
    if lane.models is not None:  # real files: find them before any folder is made
        models = resolve_models(lane, run_dir)
    run_dir, made = claim_run_dir(run_dir, unique=unique, what=what)
    try:
        record = base_record(REPO, argv=argv)
        record.update({"lane": lane.name, "params_file": str(lane.path),
                       "run_dir": str(run_dir), "threads": lane.threads,
                       "network": "loopback", "notebooks": [], "fixture": lane.fixture,
                       "backend": _backend(), "status": "running"})
        write_json(run_dir / RECORD, record)
        if lane.models is None:
            models = resolve_models(lane, run_dir)
        record["models"] = models
        record["model_sha256"] = file_hashes(list(models.values()))
    except BaseException:  # refused or failed before anything ran: leave no partial run
        discard_run_dir(run_dir, made)
        raise
    return record, models


def run_lane(params: str | Path, *, out_root: str | Path = REPO / "outputs",
             run_id: str | None = None, progress: bool = True, argv: list[str] | None = None
             ) -> Path:
    """Execute every notebook of the lane; return the run directory."""
    import papermill as pm
    from tqdm.auto import tqdm

    from mtplib.runtime.routing import POLICY_ENV, resolve_policy

    if run_id is not None:
        safe_component(run_id, "--run-id")  # one folder inside --out, never outside it
    lane = load_lane(params)
    check_lane_requirements(lane)
    kenv = kernel_env()  # before the run folder exists: a wrong kernel leaves nothing behind
    record, models = open_run(lane, Path(out_root) / (run_id or new_run_id(lane.name)),
                              argv=argv, unique=run_id is None)
    run_dir = Path(record["run_dir"])
    record_path = run_dir / RECORD
    status = "failed"  # until every notebook (and evidence README) is done
    # the lane's policy holds for every MTP path in its notebooks' kernels (they inherit
    # this environment: MTPRuntime and RangedMTP default to it)
    policy = resolve_policy(lane.policy).name
    record["policy"] = policy
    env = {POLICY_ENV: policy, **kenv}
    saved = os.environ.copy()  # restored below: the kernels' settings end with the run
    env_before = {k: saved.get(k) for k in env}
    quiet = papermill_options()  # merged stream outputs, an encrypted kernel connection
    os.environ.update(env)
    try:
        for item in tqdm(lane.notebooks, desc=f"lane {lane.name}", unit="nb", disable=not progress):
            name = item["notebook"]
            declared = pm.inspect_notebook(str(NOTEBOOKS / name))
            # shared and runner-made values go where a notebook declares them (05 reads the
            # trained pair, not the lane's models); the notebook's own were checked at load
            shared = {**lane.parameters}
            runner = {**models, "threads": lane.threads, "run_dir": str(run_dir)}
            params_in = {**{k: v for k, v in shared.items() if k in declared},
                         **(item.get("parameters") or {}),
                         **{k: v for k, v in runner.items() if k in declared}}
            for section in ("bench", "wan"):  # only to notebooks that declare it
                if getattr(lane, section) is not None and section in declared:
                    params_in[section] = getattr(lane, section)
            out_nb = run_dir / name
            t0 = now_iso()
            entry = {"notebook": name, "parameters": params_in, "started": t0}
            record["notebooks"].append(entry)
            try:
                pm.execute_notebook(str(NOTEBOOKS / name), str(out_nb), parameters=params_in,
                                    kernel_name=KERNEL, progress_bar=progress,
                                    cwd=str(run_dir), log_output=False, **quiet)
                entry["status"] = "ok"
            except Exception as e:
                why = _failure(e)
                entry["status"] = f"failed: {type(e).__name__}"
                entry["error"] = why
                record["failed_notebook"] = name
                record["partial_output"] = str(out_nb) if out_nb.exists() else None
                where = (f"partial output in {out_nb}" if out_nb.exists()
                         else f"no output was written (run folder {run_dir})")
                raise LaneFailed(f"lane {lane.name}: notebook {name} failed ({why}); {where}; "
                                 f"run record {record_path}") from e
            finally:
                entry["ended"] = now_iso()
                _merge_seam_bytes(run_dir, record)
                write_json(record_path, record)
        if lane.evidence:
            from mtplib.records.evidence import write_evidence_readme

            record["evidence"] = [str(write_evidence_readme(
                run_dir, story, run_dir / "evidence" / story / "README.md"))
                for story in lane.evidence]
        status = "ok"
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        write_json(record_path, end_record(record, status))
    return run_dir


def _failure(e: BaseException) -> str:
    """One line for a notebook's failure: the cell's exception, not papermill's banner."""
    ename, evalue = getattr(e, "ename", None), getattr(e, "evalue", None)
    text = f"{ename}: {evalue}" if ename else f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."
