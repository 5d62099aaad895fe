"""Training text: the Python standard library's own source, split by module.

The corpus is every top-level ``*.py`` file of the running interpreter's stdlib directory
(``sysconfig.get_paths()["stdlib"]``, e.g. /root/.pyenv/versions/3.11.7/lib/python3.11),
read as UTF-8, sorted by name. A module is held out when the first byte of
sha256(module name) is < 26 (about 10%): deterministic, independent of file contents and
of the order files are found in. `split.json` records both lists with each file's sha256.
Files are joined with the end-of-text token between them.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELDOUT_THRESHOLD = 26  # first byte of sha256(name) below this -> held out (26/256 ~ 10%)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(module: str) -> bool:
    return hashlib.sha256(module.encode()).digest()[0] < HELDOUT_THRESHOLD


@dataclass(frozen=True)
class Split:
    root: Path
    train: tuple[str, ...]  # module names (file stems)
    heldout: tuple[str, ...]

    def texts(self, which: str) -> list[str]:
        names = self.train if which == "train" else self.heldout
        return [(self.root / f"{n}.py").read_text(encoding="utf-8") for n in names]

    def to_dict(self) -> dict:
        def entry(n: str) -> dict:
            b = (self.root / f"{n}.py").read_bytes()
            return {"module": n, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}

        return {
            "source": str(self.root),
            "python": sys.version.split()[0],
            "rule": f"held out iff sha256(module name)[0] < {HELDOUT_THRESHOLD} "
                    "(first byte of the digest of the UTF-8 name, e.g. 'argparse')",
            "files": "every top-level *.py of the stdlib directory, sorted by name",
            "train": [entry(n) for n in self.train],
            "heldout": [entry(n) for n in self.heldout],
        }


def make_split(root: str | Path | None = None) -> Split:
    root = Path(root) if root is not None else stdlib_dir()
    names = sorted(p.stem for p in root.glob("*.py") if p.is_file())
    if not names:
        raise FileNotFoundError(f"no *.py files in {root}")
    train = tuple(n for n in names if not is_heldout(n))
    held = tuple(n for n in names if is_heldout(n))
    return Split(root, train, held)


def token_stream(docs: list[list[int]], eot: int) -> np.ndarray:
    """One int32 stream: doc, EOT, doc, EOT, ..."""
    out: list[int] = []
    for d in docs:
        out.extend(d)
        out.append(eot)
    return np.asarray(out, dtype=np.int32)


def batch(stream: np.ndarray, step: int, seed: int, batch_size: int, length: int) -> np.ndarray:
    """Windows of ``length`` tokens at random offsets; the same (seed, step) -> same batch,
    so a resumed run sees exactly the batches an uninterrupted one would."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - length, batch_size)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)
