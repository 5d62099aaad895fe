"""Reading typed result rows back from the JSON they were written as.

A lab result row is a frozen dataclass built where it is measured, read typed by its
summaries and turned into a dict only when it is written (issue 23 item 2). These two
helpers are the reading half the row classes share: the keys a row's file holds become its
fields, and a missing field is named rather than a KeyError deep inside a summary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from mtplib.errors import InputError

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
