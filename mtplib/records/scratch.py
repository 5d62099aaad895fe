"""A notebook opened on its own (in JupyterLab, or papermill without parameters) has no lane
to hand it a run folder or models. `notebook_run` gives it both: a fresh scratch run folder
under ``outputs/scratch/`` (git-ignored; found from the package, not the working directory,
which in Lab is ``notebooks/``) and the built-in fixture generated into it. Under a lane the
lane's ``run_dir``/``trunk``/``sidecar`` pass through untouched, so lanes keep working."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtplib import paths
from mtplib.errors import InputError
from mtplib.stamps import run_stamp

#: where notebooks run alone write (one folder per execution)
SCRATCH = paths.OUTPUTS / "scratch"
_STEM = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class NotebookRun:
    """What a notebook's first code cell needs: where to write, which models to read."""

    run_dir: Path
    trunk: str | None
    sidecar: str | None
    scratch: bool  # True: the folder was made here (no lane gave one)


def scratch_dir(stem: str, *, root: str | Path | None = None) -> Path:
    """A new, empty ``<root>/<stem>-<run stamp>[-N]`` (root: outputs/scratch; the stamp as
    run folders have it, `mtplib.stamps.run_stamp`)."""
    if not _STEM.match(stem):
        raise InputError(f"notebook stem {stem!r}: letters, digits, '_', '-', '.' only")
    base = Path(root) if root is not None else SCRATCH
    base.mkdir(parents=True, exist_ok=True)
    name = f"{stem}-{run_stamp()}"
    for n in range(1000):
        d = base / (name if n == 0 else f"{name}-{n}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise InputError(f"no free scratch folder name for {name} in {base}")


def notebook_run(stem: str, run_dir: str | Path | None = None, trunk: str | None = None,
                 sidecar: str | None = None, *, models: bool = True, preset: str = "tiny",
                 seed: int = 0, root: str | Path | None = None,
                 log: Callable[[str], None] | None = print) -> NotebookRun:
    """Resolve a notebook's run folder and models from its parameters.

    ``run_dir`` None (or ""): a scratch folder (``scratch_dir``). ``trunk`` and ``sidecar``
    both None and ``models``: the fixture (``preset``/``seed``) is written into
    ``run_dir/models``. Giving only one of the two is refused: a trunk with some other
    sidecar is not a pair. ``log`` (None: silent) says where the notebook writes."""
    if (trunk is None) != (sidecar is None):
        raise InputError("set both trunk and sidecar, or neither (None: the built-in fixture)")
    scratch = not run_dir
    rd = scratch_dir(stem, root=root) if scratch else Path(run_dir)
    say = log or (lambda s: None)
    say(("scratch run folder (no lane): " if scratch else "run folder: ") + str(rd))
    if models and trunk is None:
        from mtplib.model.fixture import write_fixture

        pair = write_fixture(rd / "models", seed=seed, preset=preset)
        trunk, sidecar = str(pair.trunk), str(pair.sidecar)
        say(f"fixture ({preset}, seed {seed}) written to {rd / 'models'}")
    return NotebookRun(run_dir=rd, trunk=trunk, sidecar=sidecar, scratch=scratch)
