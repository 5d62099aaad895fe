"""Shared fixtures: the tiny V4 pair is generated once per test session, never committed."""

from __future__ import annotations

import pytest

from mtplib import envs
from mtplib.model.fixture import write_combined, write_fixture
from mtplib.ownership.derivation import inventory_from_paths
from mtplib.runtime import choose_upstream

# the upstream build is chosen before any test module imports llama_cpp itself (and written
# into the environment, so the CLI and shards the tests start load the same one)
choose_upstream()


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Row-source decisions are cached on disk across processes; tests use their own
    folder so they neither read the developer's cache nor leave entries in it. The pinned
    sdist ./dev.sh keeps there (read-only: tests read upstream's tables from it) is linked."""
    mp = pytest.MonkeyPatch()
    own = tmp_path_factory.mktemp("mtplib-cache")
    sdist = envs.cache_dir() / "sdist"
    if sdist.is_dir():
        (own / "sdist").symlink_to(sdist, target_is_directory=True)
    mp.setenv(envs.CACHE_DIR, str(own))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture"), seed=0)


@pytest.fixture(scope="session")
def dspark(tmp_path_factory):
    """A tiny trunk (the `pair`'s preset and seed) with its random-weight DSpark draft:
    (FixturePair, path of dspark-<trunk>.gguf), in a folder of their own."""
    from mtplib.model.dspark.fixture import write_dspark_fixture

    out = tmp_path_factory.mktemp("dspark")
    return write_fixture(out, seed=0, sidecar=False), write_dspark_fixture(out, seed=0)


@pytest.fixture(scope="session")
def other_pair(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture_other"), seed=1)


@pytest.fixture(scope="session")
def inv(pair):
    """The tiny pair's inventory (trunk + mtp- sidecar)."""
    return inventory_from_paths(pair.trunk, pair.sidecar)


@pytest.fixture(scope="session")
def combined(pair, tmp_path_factory):
    """The inventory of the same pair written as one combined file."""
    path = write_combined(pair.trunk, pair.sidecar, tmp_path_factory.mktemp("combined"))
    return inventory_from_paths(path)


@pytest.fixture(autouse=True)
def _stock_only_allows_cache_crossing(monkeypatch):
    """Where no patched build was made (MTPLIB_SKIP_PATCHED), the suite runs on stock, which
    refuses ranged MTP by default (cache state would cross a seam): in this process the
    tests opt in, as they did before that refusal existed; subprocesses (the CLI) keep the
    user's default, and tests/test_default_path.py checks the refusal itself."""
    import mtplib.distributed.ranged_mtp as rm
    from mtplib.runtime import patched_installed

    if not patched_installed():
        check = rm.check_cache_locality
        monkeypatch.setattr(rm, "check_cache_locality",
                            lambda opts, n, *, allow: check(opts, n, allow=True))


def decode_waits(n_shards: int, seam: str | None = None) -> int:
    """Waits (synchronous round trips) of a plain ranged decode step on the loaded build,
    over ``seam`` as asked (None: the request's default, `DEFAULT_SEAM`), with local shards
    of this build and no TLS: one, the tail's output, where the seam resolves to the ring
    (patches/0007's RPC 7.2: the boundary values go shard to shard); else one per shard
    where patches/0002 and 0004 are in (one boundary tensor per seam, read in one round
    trip: evidence/upstream-patches), else two reads per seam plus the tail's output row."""
    from mtplib.runtime import build_info
    from mtplib.runtime.request import DEFAULT_SEAM
    from mtplib.runtime.rpc import client_proto_minor

    seam = DEFAULT_SEAM if seam is None else seam
    if n_shards > 1 and seam != "star" and client_proto_minor() >= 2:
        return 1
    b = build_info()
    seam_once = b["build"] == "patched" and any("0004" in p for p in b["patches"])
    return n_shards if seam_once else 2 * (n_shards - 1) + 1
