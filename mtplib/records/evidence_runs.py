"""Each evidence folder's run record: what ran to make every results file in it.

A lane writes its own ``run_record.json`` (`mtplib.records.run_record`; DGR-065, DGR-066,
wan). Every other folder's results came from scripts and lab functions run by hand; their
``run_record.json`` (schema `SCHEMA`) has one entry per results JSON with `FIELDS`: the
command, the commit, the upstream build and patch set, the host, the load average, start
and end. A field comes from the file's own content where the run wrote it (its
``provenance`` block, `mtplib.host.provenance`, or the older keys `_facts` reads), else from
git history where that can establish it (the last commit that changed the file: the code that
ran is that commit's or an earlier one's), else it says `UNKNOWN`: nothing is guessed.

A command naming an evidence script that is a module now gets ``rerun`` beside it
(`mtplib.records.moved_scripts`).

``python -m mtplib.records.evidence_runs FOLDER...`` writes the records (git history needs a
full clone); ``--check`` only reports what `problems` finds, as tests/test_evidence_runs.py
does on the committed evidence.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from mtplib import files, logs, paths
from mtplib.errors import InputError
from mtplib.host import FROM_HISTORY
from mtplib.records.moved_scripts import rerun
from mtplib.stamps import sha256_file

log = logging.getLogger(__name__)

SCHEMA = "mtplib.evidence_runs/1"
RECORD = "run_record.json"
#: what every run entry states (a value, or UNKNOWN)
FIELDS = ("command", "commit", "build", "host", "loadavg", "started", "ended")
UNKNOWN = "unknown"
#: JSON files under an evidence folder that are not results
NOT_RESULTS = frozenset({RECORD, "tokenizer.json"})
_HEX = re.compile(r"\b[0-9a-f]{64}\b")


def results_files(folder: Path) -> list[Path]:
    """The results JSON files under ``folder`` (any depth), sorted."""
    return sorted(p for p in folder.rglob("*.json") if p.name not in NOT_RESULTS)


def is_lane_record(rec: dict) -> bool:
    """A lane's record (`mtplib.records.lanes`): it covers every file of its folder."""
    return "notebooks" in rec and "git" in rec


def _first(d: dict, *keys: str):
    for k in keys:
        if d.get(k) not in (None, "", [], {}):
            return d[k]
    return None


def _facts(data) -> dict:
    """What a results file says about its own run, from its ``provenance`` block or the keys
    older writers used (``command``/``argv``, ``commit``/``git``, ``upstream``/``build``,
    ``host``/``cpu``/``hardware``/``machine``, ``loadavg*``, ``started``/``ended``)."""
    if not isinstance(data, dict):
        return {}
    out = _older_facts(data)
    prov = data.get("provenance")
    if isinstance(prov, dict):
        la = {k: prov[k] for k in ("loadavg_start", "loadavg_end") if prov.get(k)}
        mine = {"command": prov.get("command"),
                "commit": prov.get("commit") or (prov.get("git") or {}).get("commit"),
                "build": prov.get("build"), "host": prov.get("host"), "loadavg": la or None,
                "started": prov.get("started"), "ended": prov.get("ended")}
        mine = {k: v for k, v in mine.items() if v not in (None, "", {}, [], UNKNOWN)}
        out.update(mine)
        out["recorded"] = prov.get("recorded")
        if prov.get("recorded") == FROM_HISTORY:  # a block `stamp` added, not the run
            out["from_history"] = sorted(mine)
            out["commit_is"] = prov.get("commit_is")
    return out


def _older_facts(data: dict) -> dict:
    out: dict = {}
    cmd = _first(data, "command", "argv")
    out["command"] = " ".join(map(str, cmd)) if isinstance(cmd, list) else cmd
    host = _first(data, "host", "cpu", "hardware", "machine")
    commit = data.get("commit") or (data.get("git") or {}).get("commit")
    if commit is None and isinstance(host, dict):
        commit = host.get("commit") or (host.get("git") or {}).get("commit")
    out["commit"] = commit
    build = _first(data, "upstream", "build")
    if isinstance(build, str):
        build = {"build": build}
    if build is None and isinstance(data.get("builds"), (list, dict)):  # one run per build
        build = {"builds": list(data["builds"])}
    runs = [r for r in data.get("runs") or [] if isinstance(r, dict)]
    if commit is None and runs and all(r.get("commit") for r in runs):  # appended runs
        commit = sorted({r["commit"] for r in runs})
        commit = commit[0] if len(commit) == 1 else commit
        build = build or [r.get("build") for r in runs]
        out["started"] = runs[0].get("started")
        out["ended"] = runs[-1].get("ended")
        la = [r["host"] for r in runs if isinstance(r.get("host"), dict)]
        host = host or (la[0] if la else None)
    out["build"] = build
    out["host"] = host
    la = {k: v for k, v in data.items() if "loadavg" in k and v not in (None, [])}
    if isinstance(host, dict):
        la.update({k: v for k, v in host.items() if "loadavg" in k and v not in (None, [])})
    out["loadavg"] = la or None
    out["started"] = data.get("started") or out.get("started")
    out["ended"] = data.get("ended") or out.get("ended")
    return out


def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def last_changed_in(path: Path, repo: Path) -> tuple[str, str] | None:
    """(commit, ISO date) of the last commit that changed ``path`` (the code that wrote its
    content is that commit's or an earlier one's), or None where git history does not say
    (a shallow clone, an uncommitted file)."""
    rel = path.resolve().relative_to(repo.resolve()).as_posix()
    for line in _git(repo, "log", "--format=%H %cI", "--", rel).splitlines():
        commit, date = line.split(" ", 1)
        if not _only_stamped(repo, commit, rel):
            return commit, date
    return None


def _results_at(repo: Path, rev: str, rel: str):
    """The file at ``rev`` without the blocks `stamp` and `lane_afterwards` add (None where
    it is absent or not JSON)."""
    try:
        data = json.loads(_git(repo, "show", f"{rev}:{rel}") or "null")
    except ValueError:
        return None
    if isinstance(data, dict):
        prov = data.get("provenance")
        if isinstance(prov, dict) and prov.get("recorded") == FROM_HISTORY:
            data.pop("provenance")
        data.pop("recorded_afterwards", None)
    return data


def _only_stamped(repo: Path, commit: str, rel: str) -> bool:
    """Did ``commit`` only add a block recorded afterwards to ``rel`` (its results as
    before)? Such a commit did not write the results, so it does not date them."""
    now = _results_at(repo, commit, rel)
    return now is not None and now == _results_at(repo, f"{commit}^", rel)


def first_patch_commit(repo: Path) -> str | None:
    """The commit that added the first file under ``patches/``: before it only the stock
    pinned build existed, so a file added by a commit that does not descend from it was
    made on the stock build."""
    lines = _git(repo, "log", "--diff-filter=A", "--format=%H", "--", "patches/").splitlines()
    return lines[-1] if lines else None


def _before_patches(commit: str, repo: Path) -> bool:
    first = first_patch_commit(repo)
    if first is None:
        return False
    r = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", first, commit],
                       capture_output=True, timeout=30)
    return r.returncode == 1  # 0: descends from it; 1: does not; other: git could not say


def _default_build(commit: str, repo: Path) -> str:
    """The build `selected_upstream` chose at ``commit`` when MTPLIB_UPSTREAM was unset."""
    src = _git(repo, "show", f"{commit}:mtplib/runtime/__init__.py")
    m = re.search(r'"MTPLIB_UPSTREAM",\s*"(\w+)"', src)
    return m.group(1) if m else UNKNOWN


def entry(path: Path, folder: Path, repo: Path) -> dict:
    """One results file's run entry: its own facts, then git history, then UNKNOWN."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable results file ({e})") from None
    facts = _facts(data)
    e: dict = {"file": path.relative_to(folder).as_posix()}
    e.update({k: facts.get(k) if facts.get(k) not in (None, "", {}, []) else UNKNOWN
              for k in FIELDS})
    again = rerun(e["command"], folder.resolve().relative_to(repo.resolve()).as_posix())
    if again is not None:  # the script is a module now: the same arguments through it
        e["rerun"] = again
    later = facts.get("from_history", [])
    own = [k for k in FIELDS if e[k] != UNKNOWN and k not in later]
    e["from_the_file"] = own
    e["recorded"] = ("at run time" if own else UNKNOWN) if later else (
        facts.get("recorded") or ("at run time" if own else UNKNOWN))
    if later:
        e["from_git_history"] = later
        if facts.get("commit_is"):
            e["commit_is"] = facts["commit_is"]
    hist = last_changed_in(path, repo)
    if hist is not None:
        e["committed_in"] = {"commit": hist[0], "date": hist[1], "recorded": FROM_HISTORY}
        if e["commit"] == UNKNOWN:
            e["commit"] = hist[0]
            e.setdefault("from_git_history", []).append("commit")
            e["commit_is"] = ("the last commit that changed the file (" + FROM_HISTORY
                              + "): the code that ran is this commit's or an earlier one's")
        if e["ended"] == UNKNOWN:
            e["ended_by"] = hist[1]
        if e["build"] == UNKNOWN and not _before_patches(hist[0], repo):
            e["build_unknown_why"] = (
                "the run did not record its build or its environment (MTPLIB_UPSTREAM); "
                f"the default build at {hist[0][:12]} was {_default_build(hist[0], repo)!r}")
        if e["build"] == UNKNOWN and _before_patches(hist[0], repo):
            e.setdefault("from_git_history", []).append("build")
            e["build"] = {"build": "stock", "patches": [], "how": (
                FROM_HISTORY + ": the file was last changed before patches/ existed "
                f"({first_patch_commit(repo)}), when the stock pinned build was the only one")}
    return e


def lane_afterwards(folder: Path) -> dict:
    """What a lane's record lacks, recorded afterwards: the load average (older lanes did
    not record it) and, where the record has no ``upstream``, the build of each results
    file that names one (a lane running both builds, like wan's)."""
    rec = json.loads((folder / RECORD).read_text())
    out: dict = {"recorded": FROM_HISTORY + " and the folder's own results files"}
    if not rec.get("loadavg_start"):
        out["loadavg"] = (f"{UNKNOWN}: the lane at {(rec.get('git') or {}).get('commit')} "
                          "did not record it")
    if not rec.get("upstream"):
        builds = {}
        for p in results_files(folder):
            b = _facts(json.loads(p.read_text())).get("build")
            if isinstance(b, dict) and b.get("build"):
                builds[p.relative_to(folder).as_posix()] = {
                    k: b.get(k) for k in ("build", "patch_set_sha256", "patches")}
        out["upstream"] = builds or UNKNOWN
    return out


def _insert(path: Path, key: str, block: dict) -> bool:
    """``block`` under ``key`` in the JSON object at ``path``, inserted before its last
    brace (every other byte stays); False where it is not an object or has ``key``."""
    text = path.read_text()
    body = text.rstrip()
    if not body.startswith("{") or not body.endswith("}") or f'"{key}"' in text:
        return False
    indent = " " if "\n \"" in body[:200] else "  "
    inner = json.dumps(block, indent=len(indent)).replace("\n", "\n" + indent)
    sep = "" if body[:-1].rstrip().endswith("{") else ","
    new = body[:-1].rstrip() + f'{sep}\n{indent}"{key}": {inner}\n}}' + text[len(body):]
    json.loads(new)  # still one valid object
    path.write_text(new)
    return True


def stamp(path: Path, e: dict) -> bool:
    """Add to a committed results file (a JSON object without one) a ``provenance`` block
    holding what `entry` established from git history, marked as recorded afterwards. The
    block is inserted before the object's last brace, so every other byte stays as it is.
    False where the file is not an object or already says."""
    own = e.get("from_the_file", [])
    block = {"recorded": FROM_HISTORY, "commit": e["commit"],
             "commit_is": e.get("commit_is", "the commit recorded in the file"),
             "build": e["build"], "committed_in": e.get("committed_in", UNKNOWN),
             "other_facts": "the folder's run_record.json (unknown where it says so)"}
    for k in ("commit", "build"):  # what the file says itself stays said once, there
        if k in own:
            block.pop(k)
            block.pop("commit_is", None) if k == "commit" else None
    if e.get("build_unknown_why"):
        block["build_unknown_why"] = e["build_unknown_why"]
    return _insert(path, "provenance", block)


def folder_record(folder: Path, repo: Path = paths.REPO) -> dict:
    """The run record of a hand-run evidence folder, one entry per results file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder")
    rel = folder.resolve().relative_to(repo.resolve()).as_posix()
    return {"schema": SCHEMA, "folder": rel,
            "written_by": "python -m mtplib.records.evidence_runs " + rel,
            "fields": list(FIELDS), "unknown": UNKNOWN,
            "runs": [entry(p, folder, repo) for p in results_files(folder)]}


def problems(folder: Path) -> list[str]:
    """Why ``folder``'s run record does not say what ran (empty: it does)."""
    folder = Path(folder)
    p = folder / RECORD
    if not p.is_file():
        return [f"{folder.name}: no {RECORD}"]
    try:
        rec = json.loads(p.read_text())
    except ValueError as e:
        return [f"{p}: not JSON ({e})"]
    if not isinstance(rec, dict):
        return [f"{p}: not a JSON object"]
    if is_lane_record(rec):
        later = rec.get("recorded_afterwards") or {}
        need = {"command": rec.get("command"), "commit": (rec.get("git") or {}).get("commit"),
                "build": rec.get("upstream") or later.get("upstream"),
                "host": rec.get("cpu"),
                "loadavg": rec.get("loadavg_start") or later.get("loadavg"),
                "started": rec.get("started"), "ended": rec.get("ended")}
        return [f"{p}: lane record without {k}" for k, v in need.items() if not v]
    if rec.get("schema") != SCHEMA:
        return [f"{p}: neither a lane's run record nor a {SCHEMA} one"]
    out = []
    runs = {r.get("file"): r for r in rec.get("runs", [])}
    for f in results_files(folder):
        name = f.relative_to(folder).as_posix()
        r = runs.get(name)
        if r is None:
            out.append(f"{p}: no run entry for {name}")
            continue
        out += [f"{p}: {name} lacks {k}" for k in FIELDS if r.get(k) in (None, "", {}, [])]
        if r.get("commit") == UNKNOWN:
            out.append(f"{p}: {name} names no commit")
        if r.get("build") == UNKNOWN and not r.get("build_unknown_why"):
            out.append(f"{p}: {name} names no build and says not why")
    return out


def quoted_hashes(folder: Path) -> set[str]:
    """The sha256 values the folder's Markdown quotes: a file whose hash is quoted there is
    never stamped (its bytes are what the README pins)."""
    return {m for md in folder.rglob("*.md") for m in _HEX.findall(md.read_text())}


def stamp_folder(folder: Path, repo: Path = paths.REPO) -> list[Path]:
    """`stamp` every results file under ``folder`` that names no commit or no build and
    whose bytes no README pins, in a folder no lane wrote (a lane's record names the commit
    and build of its files; its hand-run files are stamped one by one, `stamp`); the files
    stamped."""
    rec = folder / RECORD
    if rec.is_file() and is_lane_record(json.loads(rec.read_text())):
        return []
    pinned = quoted_hashes(folder)
    done = []
    for p in results_files(folder):
        e = entry(p, folder, repo)
        if {"commit", "build"} <= set(e["from_the_file"]) or sha256_file(p) in pinned:
            continue
        if stamp(p, e):
            done.append(p)
    return done


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtplib.records.evidence_runs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="evidence folders")
    ap.add_argument("--check", action="store_true", help="only report, write nothing")
    ap.add_argument("--stamp", action="store_true",
                    help="first add a provenance block, from git history, to each results "
                         "file that names no commit or build (`stamp_folder`)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    logs.configure()
    bad = 0
    try:
        for f in map(Path, a.folders):
            if a.stamp and not a.check:
                for p in stamp_folder(f):
                    print(f"{p}: stamped from git history")
            if not a.check:
                lane = f / RECORD
                if lane.is_file() and is_lane_record(json.loads(lane.read_text())):
                    if _insert(lane, "recorded_afterwards", lane_afterwards(f)):
                        print(f"{lane}: a lane's run record, completed afterwards")
                else:
                    files.write_json(lane, folder_record(f), indent=1, sort_keys=False)
                    print(lane)
            for line in problems(f):
                print(line)
                bad = 1
    except InputError as e:
        log.error("error: %s", e)
        return 2
    return bad


if __name__ == "__main__":
    raise SystemExit(main())
