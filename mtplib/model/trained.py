"""Where the committed trained tiny V4 pair lies (evidence/trained-v4/), where its trained
DSpark draft lies (evidence/trained-dspark/), and their file names.

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


DSPARK_DIR = EVIDENCE / "trained-dspark"
DSPARK_NAME = "dspark-v4-trained.gguf"
DSPARK_PARITY_NAME = "parity_dspark.npz"


@dataclass(frozen=True)
class TrainedDSpark:
    """The trained DSpark draft of the trained trunk and its stored torch reference."""

    draft: Path
    parity: Path

    def exists(self) -> bool:
        return self.draft.exists() and self.parity.exists()


def trained_dspark_paths(root: str | Path | None = None) -> TrainedDSpark:
    d = Path(root) if root is not None else DSPARK_DIR
    return TrainedDSpark(d / DSPARK_NAME, d / DSPARK_PARITY_NAME)
