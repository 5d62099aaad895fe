"""Write a notebook from a list of (kind, source) cells, outputs empty.

Kept in the repo so notebook sources can be regenerated from a readable script:
    python tools/nbwrite.py   (writes every notebook defined in tools/notebooks_src.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def write(name: str, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, src) in enumerate(cells):
        src = src.strip("\n")
        if kind == "md":
            c = nbformat.v4.new_markdown_cell(src)
        else:
            c = nbformat.v4.new_code_cell(src)
            if kind == "params":
                c.metadata["tags"] = ["parameters"]
        c.id = f"c{i:02d}"
        nb.cells.append(c)
    path = ROOT / "notebooks" / name
    nbformat.write(nb, str(path))
    return path


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import notebooks_src

    for name, cells in notebooks_src.NOTEBOOKS.items():
        print(write(name, cells))
