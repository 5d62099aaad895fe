"""Result rows on disk: read back typed from the JSON they were written as, and written as
tidy tables (every CSV a run writes and `mtplib.records.load` share).

A lab result row is a frozen dataclass built where it is measured, read typed by its
summaries and turned into a dict only when it is written (issue 23 item 2). `row_from_dict`
and `typed` are the reading half the row classes share: the keys a row's file holds become
its fields, and a missing field is named rather than a KeyError deep inside a summary.

A written row is a JSON-friendly dict whose values may nest (per draft position, per step
kind, per class). A table wants one scalar per cell, so `flatten` spreads a list over
numbered columns (``accepted_per_position_1``, ``_2``...: positions count from 1) and a
dict over keyed columns (``rollbacks_tail``, ``seam_by_step_verify``), recursively. Token
streams and command lines (`KEEP`) stay one list per cell in a DataFrame (a JSON list in a
CSV). Integer columns stay integer when some rows lack the value (pandas' nullable
``Int64``: ``rep`` of a warm-up run is <NA>, never a float NaN), and counters
(`COUNTERS`) that a row lacks count 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mtplib.errors import InputError

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")


def row_from_dict(cls: type[T], r: Mapping[str, Any], what: str,
                  required: Iterable[str] = ()) -> T:
    """``cls`` from the keys of ``r`` that are its fields (others are ignored: a newer file
    may hold more); every field without a default, and each of ``required``, must be there
    (InputError naming them and ``what`` the row is)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    kw = {k: v for k, v in r.items() if k in names}
    must = [f.name for f in fields(cls)  # type: ignore[arg-type]
            if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in [*must, *required] if n not in kw]
    if missing:
        raise InputError(f"{what} lacks {', '.join(missing)}: {sorted(r)}")
    return cls(**kw)


def typed(cls: type[T], rows: Iterable[T | Mapping[str, Any]]) -> list[T]:
    """Rows as ``cls`` (rows read back from a file are dicts, through ``cls.from_dict``;
    typed ones pass through)."""
    return [r if isinstance(r, cls) else cls.from_dict(r) for r in rows]  # type: ignore[attr-defined]


#: values kept whole (one list per cell): a sequence's length is not a table's width
KEEP = frozenset({"tokens", "argv", "prompt"})
#: lists of names written as one comma-separated text
JOIN = frozenset({"patches"})
#: dicts of counts: a key a row lacks counted 0 there (``rollbacks`` lists only kinds seen)
COUNTERS = frozenset({"rollbacks"})


def flatten(row: dict, *, sep: str = "_") -> dict:
    """One row with every nested list or dict spread over columns (module docstring)."""
    out: dict[str, Any] = {}

    def put(key: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                put(f"{key}{sep}{k}", x)
        elif isinstance(v, list | tuple) and not any(isinstance(x, dict | list) for x in v):
            for i, x in enumerate(v):
                out[f"{key}{sep}{i + 1}"] = x
        else:
            out[key] = v

    for key, v in row.items():
        if key in KEEP and isinstance(v, list | tuple):
            out[key] = list(v)
        elif key in JOIN and isinstance(v, list | tuple):
            out[key] = ",".join(str(x) for x in v)
        else:
            put(key, v)
    return out


def _dtype(values: Iterable[Any]) -> str | None:
    """Nullable dtype for a column of ints or bools with gaps (None if pandas' own fits)."""
    vs = list(values)
    present = [v for v in vs if v is not None and not (isinstance(v, float) and v != v)]
    if len(present) == len(vs) or not present:
        return None
    if all(isinstance(v, bool) for v in present):
        return "boolean"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "Int64"
    return None


def frame(rows: Sequence[dict], **columns: Any) -> pd.DataFrame:
    """The rows as a tidy DataFrame (`flatten`); ``columns``: constant columns put first
    (e.g. ``build="stock"``)."""
    import pandas as pd

    flat = []
    groups: dict[str, dict[str, None]] = {}  # a row's key -> its columns, kept together
    for r in [{**columns, **r} for r in rows]:
        out: dict[str, Any] = {}
        for key, v in r.items():
            cols = flatten({key: v})
            groups.setdefault(key, {}).update(dict.fromkeys(cols))
            out.update(cols)
        flat.append(out)
    names = {c: None for g in groups.values() for c in g}
    counters = [c for c in names if any(c.startswith(p + "_") for p in COUNTERS)]
    for r in flat:
        for c in counters:
            r.setdefault(c, 0)
    df = pd.DataFrame(flat, columns=list(names))
    for c in names:
        dt = _dtype(r.get(c) for r in flat)
        if dt is not None:
            df[c] = pd.array([r.get(c) for r in flat], dtype=dt)
    return df


def to_csv(rows: Sequence[dict] | pd.DataFrame, path: str | Path, **columns: Any) -> Path:
    """Write rows (or a `frame`) as CSV: one scalar per cell, a kept list as JSON text, an
    unmeasured value as an empty cell."""
    df = rows if hasattr(rows, "to_csv") else frame(rows, **columns)
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object:
            df[c] = [json.dumps(v) if isinstance(v, list | dict) else v for v in df[c]]
    path = Path(path)
    df.to_csv(path, index=False, lineterminator="\n")
    return path
