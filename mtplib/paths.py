"""Where the repository's folders are, from the package's own location, so that defaults
resolve the same whatever the working directory."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EVIDENCE = REPO / "evidence"
OUTPUTS = REPO / "outputs"
PARAMS = REPO / "params"
NOTEBOOKS = REPO / "notebooks"
#: the lane `mtplib run` and `mtplib bench` use when --params is not given
DEFAULT_LANE = PARAMS / "cpu-fixture.yaml"
