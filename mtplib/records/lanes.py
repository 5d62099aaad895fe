"""`mtplib run`: execute a lane's notebooks with papermill into outputs/<run-id>/.

A lane is one YAML file in params/. The pipeline prepares the models (generating the
built-in fixture when the lane asks for it), injects their paths into every notebook's
`parameters` cell, and writes a run record next to the executed notebooks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mtplib import paths
from mtplib.errors import InputError
from mtplib.records.raw_metrics import read_seam_bytes
from mtplib.records.run_record import base_record, file_hashes, write_json
from mtplib.stamps import now_iso, run_stamp

REPO = paths.REPO
NOTEBOOKS = REPO / "notebooks"


class LaneError(InputError):
    """A params file that is malformed or asks for what this machine lacks."""


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
    bench: dict | None = None  # the `bench:` section (mtplib.lab.bench.BenchConfig)
    evidence: list[str] = field(default_factory=list)  # stories whose README a run writes
    wan: dict | None = None  # the `wan:` section (mtplib.lab.wan.WanConfig)
    #: `policy:` alpha | beta, for the bench and every notebook's MTP runs (None:
    #: $MTPLIB_POLICY, else beta); under alpha a lane with a bench stops before anything runs
    policy: str | None = None
    requires: dict | None = None  # hardware: {gpus: N, gpu_memory_gb: G, hardware: "text"}


REQUIRES_KEYS = {"gpus", "gpu_memory_gb", "hardware"}


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
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0 \
            or isinstance(mem, bool) or not isinstance(mem, int | float) or mem < 0:
        raise LaneError(f"{p}: requires.gpus must be an int >= 0 and requires.gpu_memory_gb "
                        f"a number >= 0, got {req!r}")
    return {"gpus": gpus, "gpu_memory_gb": float(mem), "hardware": str(req["hardware"])}


def load_lane(path: str | Path) -> Lane:
    p = Path(path)
    if not p.exists():
        raise LaneError(f"params file not found: {p} (lanes live in params/*.yaml)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise LaneError(f"{p}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise LaneError(f"{p}: expected a mapping at the top level")
    unknown = set(data) - {"lane", "description", "notebooks", "fixture", "models", "threads",
                           "parameters", "bench", "evidence", "wan", "policy", "requires"}
    if unknown:
        raise LaneError(f"{p}: unknown keys {sorted(unknown)}")
    nbs = data.get("notebooks") or []
    if not nbs:
        raise LaneError(f"{p}: 'notebooks' must list at least one notebook")
    norm = []
    for item in nbs:
        item = {"notebook": item} if isinstance(item, str) else dict(item)
        nb = NOTEBOOKS / item["notebook"]
        if not nb.exists():
            raise LaneError(f"{p}: notebook {item['notebook']} not found in {NOTEBOOKS}")
        norm.append(item)
    if bool(data.get("fixture")) == bool(data.get("models")):
        raise LaneError(f"{p}: give exactly one of 'fixture' (generated) or 'models' (files)")
    policy = data.get("policy")
    if policy is not None:
        from mtplib.contract.capabilities import policy_named

        try:
            policy_named(policy)
        except InputError as e:
            raise LaneError(f"{p}: {e}") from None
    return Lane(name=str(data.get("lane", p.stem)), path=p, notebooks=norm,
                fixture=data.get("fixture"), models=data.get("models"),
                threads=int(data.get("threads", 2)), parameters=data.get("parameters") or {},
                description=str(data.get("description", "")), bench=data.get("bench"),
                wan=data.get("wan"),
                evidence=[str(s) for s in data.get("evidence") or []], policy=policy,
                requires=_requires(p, data.get("requires")))


def _storage_root(models: dict) -> Path:
    root = models.get("storage_root") or os.environ.get("MTPLIB_MODEL_ROOT")
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


def check_lane_requirements(lane: Lane) -> None:
    """Stop before anything runs when the lane's bench section is malformed or needs what
    this machine lacks (e.g. a GPU build); and when it asks for an unknown evidence story."""
    if lane.evidence:
        from mtplib.records.evidence import WRITERS

        unknown = [s for s in lane.evidence if s not in WRITERS]
        if unknown:
            raise LaneError(f"lane {lane.name}: no evidence README writer for {unknown} "
                            f"(known: {sorted(WRITERS)})")
    needs = f" (lane needs: {lane.requires['hardware']})" if lane.requires else ""
    if lane.bench is not None:
        from mtplib.lab.bench import BenchConfig, MissingCapability, check_requirements

        try:
            check_requirements(BenchConfig.from_dict(lane.bench, threads=lane.threads,
                                                     policy=lane.policy))
        except MissingCapability as e:
            raise LaneError(f"lane {lane.name}: {e}{needs}") from None
        except ValueError as e:
            raise LaneError(f"{lane.path}: {e}") from None
    if lane.requires and lane.requires["gpus"]:
        from mtplib.runtime.devices import gpu_devices

        check_gpus(lane, gpu_devices())


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


def new_run_id(lane: str) -> str:
    return run_stamp() + "-" + re.sub(r"[^\w.-]", "_", lane)


def open_run(lane: Lane, run_dir: Path, *, argv: list[str] | None = None,
             what: str = "--run-id") -> tuple[dict, dict]:
    """Create the run folder (refusing a non-empty one), write its first run record,
    resolve the lane's models (generating fixtures into the folder). Returns (record,
    models); the caller updates the record and writes it again with `write_json`. The one
    run-record setup of lanes (`run_lane`) and `mtplib bench`."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise LaneError(f"{run_dir} already exists and is not empty; pick another {what}")
    run_dir.mkdir(parents=True, exist_ok=True)
    record = base_record(REPO, argv=argv)
    record.update({"lane": lane.name, "params_file": str(lane.path), "run_dir": str(run_dir),
                   "threads": lane.threads, "network": "loopback", "notebooks": [],
                   "fixture": lane.fixture, "backend": _backend()})
    write_json(run_dir / "run_record.json", record)
    models = resolve_models(lane, run_dir)
    record["models"] = models
    record["model_sha256"] = file_hashes(list(models.values()))
    return record, models


def run_lane(params: str | Path, *, out_root: str | Path = REPO / "outputs",
             run_id: str | None = None, progress: bool = True, argv: list[str] | None = None
             ) -> Path:
    """Execute every notebook of the lane; return the run directory."""
    import papermill as pm
    from tqdm.auto import tqdm

    from mtplib.runtime.routing import POLICY_ENV, resolve_policy

    lane = load_lane(params)
    check_lane_requirements(lane)
    run_dir = Path(out_root) / (run_id or new_run_id(lane.name))
    record, models = open_run(lane, run_dir, argv=argv)
    record_path = run_dir / "run_record.json"
    status = "ok"
    # the lane's policy holds for every MTP path in its notebooks' kernels (they inherit
    # this environment: MTPRuntime and RangedMTP default to it)
    policy = resolve_policy(lane.policy).name
    record["policy"] = policy
    env_before = os.environ.get(POLICY_ENV)
    os.environ[POLICY_ENV] = policy
    try:
        for item in tqdm(lane.notebooks, desc=f"lane {lane.name}", unit="nb", disable=not progress):
            name = item["notebook"]
            params_in = {**lane.parameters, **(item.get("parameters") or {}), **models,
                         "threads": lane.threads, "run_dir": str(run_dir)}
            declared = pm.inspect_notebook(str(NOTEBOOKS / name))
            for section in ("bench", "wan"):  # only to notebooks that declare it
                if getattr(lane, section) is not None and section in declared:
                    params_in[section] = getattr(lane, section)
            out_nb = run_dir / name
            t0 = now_iso()
            entry = {"notebook": name, "parameters": params_in, "started": t0}
            record["notebooks"].append(entry)
            try:
                pm.execute_notebook(str(NOTEBOOKS / name), str(out_nb), parameters=params_in,
                                    kernel_name="python3", progress_bar=progress,
                                    cwd=str(run_dir), log_output=False)
                entry["status"] = "ok"
            except Exception as e:
                entry["status"] = f"failed: {type(e).__name__}"
                status = "failed"
                raise
            finally:
                entry["ended"] = now_iso()
                _merge_seam_bytes(run_dir, record)
                write_json(record_path, record)
        if lane.evidence:
            from mtplib.records.evidence import write_evidence_readme

            try:
                record["evidence"] = [str(write_evidence_readme(
                    run_dir, story, run_dir / "evidence" / story / "README.md"))
                    for story in lane.evidence]
            except Exception:
                status = "failed"
                raise
    finally:
        if env_before is None:
            os.environ.pop(POLICY_ENV, None)
        else:
            os.environ[POLICY_ENV] = env_before
        record["ended"] = now_iso()
        record["status"] = status
        write_json(record_path, record)
    return run_dir
