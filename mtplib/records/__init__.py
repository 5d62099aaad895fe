"""Lanes, run records and evidence writers; `load` reads a run's results as DataFrames
(`mtplib.records.frames`, imported on first use: the CLI's imports stay light)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtplib.records.frames import load

__all__ = ["load"]


def __getattr__(name: str):
    if name == "load":
        from mtplib.records.frames import load

        return load
    raise AttributeError(f"module 'mtplib.records' has no attribute {name!r}")
