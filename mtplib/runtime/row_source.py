"""Where the MTP loop takes the target's `h_nextn` rows from, per context configuration.

`choose_row_source` answers "api" (upstream's rows were proven right), "captured" (they
were wrong, the rows captured through the eval callback check out against the logits) or
"unsupported" (neither can be trusted: do not draft), by running
`mtplib.runtime.hidden_check.check_hidden` once per complete key and keeping the verdict
in this process and on disk. The engines and the llama adapter call it when they build a
target context; reading the rows each step is `mtplib.runtime.rows`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from mtplib import envs, pins
from mtplib.files import write_json
from mtplib.runtime import hidden_check
from mtplib.runtime.hidden_check import (
    CHECK_VERSION,
    CONFIG_FIELDS,
    FOLLOWUPS,
    ROWS_ONLY_FOLLOWUPS,
    as_config,
    decide,
)
from mtplib.runtime.model import ContextConfig, Model


@dataclass(frozen=True)
class RowSourceDecision:
    """A configuration's row source, why, and the `check_hidden` report it came from."""

    mode: str  # "api" | "captured" | "unsupported"
    reason: str
    report: dict

    def to_dict(self) -> dict:
        return asdict(self)


#: decisions made in this process, by key id (`_key_id`)
_DECISIONS: dict[str, RowSourceDecision] = {}


def clear_cache(*, disk: bool = False) -> None:
    """Forget the decisions made in this process (and, ``disk``, those on disk)."""
    _DECISIONS.clear()
    if disk:
        for p in _cache_dir().glob("*.json"):
            p.unlink(missing_ok=True)


def _cache_dir() -> Path:
    return envs.cache_dir() / "row-source"


def _cache_key(path: Path, c: ContextConfig, reserve: bool,
               followups: Sequence[tuple[int, str]]) -> dict:
    """Everything the decision depends on: the pinned upstream, the model file, every
    context parameter (swa_full and n_seq_max change the graph and the cache layout, so a
    check made with one setting says nothing about the other), masking, the reserve fix
    and the decode shapes checked."""
    p = path.resolve()
    st = p.stat()
    return {"check": CHECK_VERSION, "upstream": pins.LLAMA_CPP_COMMIT, "model": str(p),
            "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "context": {f.name: getattr(c, f.name) for f in fields(ContextConfig)
                        if f.name != "no_perf"},
            "reserve": bool(reserve), "followups": [list(f) for f in followups]}


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _load_decision(key: dict) -> RowSourceDecision | None:
    p = _cache_dir() / f"{_key_id(key)}.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if d.get("key") != key or d.get("mode") not in ("api", "captured", "unsupported"):
        return None
    return RowSourceDecision(d["mode"], d["reason"], d.get("report", {}))


def _store_decision(key: dict, d: RowSourceDecision) -> None:
    p = _cache_dir() / f"{_key_id(key)}.json"
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_json(p, {"key": key, **d.to_dict()}, indent=None, default=str, end="")
    except OSError:  # a read-only home: the decision is still made, just not kept
        pass


def check_length(c: ContextConfig, followups: Sequence[tuple[int, str]] = FOLLOWUPS) -> int:
    """A prompt that spans about three ubatches and fits the context with the follow-ups."""
    n_ub = min(c.n_ubatch, c.n_batch, c.n_ctx)
    room = c.n_ctx // max(1, c.n_seq_max) - sum(n for n, _ in followups)  # one sequence's share
    return max(1, min(2 * n_ub + 3, room))


def choose_row_source(model: str | Path | Model, ctx_cfg: ContextConfig | dict, *,
                      n_tokens: int | None = None, reserve: bool = False,
                      use_cache: bool = True) -> RowSourceDecision:
    """Where the MTP loop takes the target's rows from, for this context configuration.

    Runs `check_hidden` once per complete key (`_cache_key`: pin, model file, every context
    parameter, masked, reserve) on throwaway contexts, and keeps the decision in this
    process and on disk (``~/.cache/mtplib/row-source``, or ``$MTPLIB_CACHE_DIR``), so a
    new process, a notebook kernel or a shard worker does not check again. A model loaded
    across RPC shards is checked on a local CPU load of the same file: the answer never
    costs shard round trips. Masked comes from ``ctx_cfg.nextn_rows``.
    "api": the API rows were right; "captured": they were wrong but the captured rows
    check out against the logits; "unsupported": neither can be trusted (do not draft).
    ``reserve``: the caller calls `force_reserve` on its target context; the check does too.
    The check samples decode shapes (a multi-ubatch prompt, 1-4 tokens, an 8-token chunk);
    "api" is as good as that sample (on the fixture the outcome was the same for every
    decode length 1..64 of a configuration).
    """
    cfg = ctx_cfg if isinstance(ctx_cfg, ContextConfig) else ContextConfig(**ctx_cfg)
    masked = cfg.nextn_rows == "masked"
    c = as_config(cfg, masked)
    path = model.path if isinstance(model, Model) else Path(model)
    fups = FOLLOWUPS + (() if masked else ROWS_ONLY_FOLLOWUPS)
    key = _cache_key(path, c, reserve, fups)
    kid = _key_id(key)
    if use_cache:
        if kid in _DECISIONS:
            return _DECISIONS[kid]
        d = _load_decision(key)
        if d is not None:
            _DECISIONS[kid] = d
            return d
    if isinstance(model, Model) and getattr(model, "endpoints", None):
        model = path  # ranged: check a local CPU load, not through the shards
    n = n_tokens or check_length(c, fups)
    local = None
    try:
        if not isinstance(model, Model):  # CPU only: a process with RPC shards registered
            from mtplib.runtime.rpc import cpu_device  # would spread a default load on them

            model = local = Model(model, devices=[cpu_device()])
        report = hidden_check.check_hidden(model, c, n, masked, reserve=reserve, followups=fups)
    except Exception as e:  # noqa: BLE001 - any failure of the check is fail-closed
        report = {"error": f"{type(e).__name__}: {e}", "capture_ok": False,
                  "config": {f: getattr(c, f) for f in CONFIG_FIELDS} | {"masked": masked}}
    finally:
        if local is not None:
            local.close()
    mode, reason = decide(report)
    d = RowSourceDecision(mode, reason, report)
    if use_cache and "error" not in report:
        _DECISIONS[kid] = d
        _store_decision(key, d)
    return d
