"""Where the committed trained tiny V4 pair lies (evidence/trained-v4/) and its file names.

Pure: the fixture layer, the lab's measurements and the trainer's export all name the pair
through this one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtplib.paths import EVIDENCE

EVIDENCE_DIR = EVIDENCE / "trained-v4"
TRUNK_NAME = "v4-trained.gguf"
SIDECAR_NAME = "mtp-v4-trained.gguf"
PARITY_NAME = "parity_logits.npz"


@dataclass(frozen=True)
class TrainedPair:
    trunk: Path
    sidecar: Path
    parity: Path

    def exists(self) -> bool:
        return all(p.exists() for p in (self.trunk, self.sidecar, self.parity))


def trained_paths(root: str | Path | None = None) -> TrainedPair:
    d = Path(root) if root is not None else EVIDENCE_DIR
    return TrainedPair(d / TRUNK_NAME, d / SIDECAR_NAME, d / PARITY_NAME)
