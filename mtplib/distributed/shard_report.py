"""What each shard says it runs, and the adverts a ranged run routes on, built from that.

Why: upstream's RPC protocol carries a protocol version and device facts only, so the
client cannot learn there which mtplib contract, llama-cpp-python / llama.cpp pin, build
(stock or patched) and patch set a shard runs; adverts the client built from its own pin
could never fail the pin or contract checks. So every ``mtplib shard serve`` process
reports its own (`local_report`, from the upstream library it loaded) through the one
channel it has to the client:

- a TLS shard: its gateway's ready line (``mtplib-gateway 1 ready <instance> <report>``),
  which only a client with a certificate of the shard's CA reads;
- a plaintext shard: a report file (`write_report_file`) in this user's report directory
  (`report_dir`, mode 0700), named by the endpoint and holding the serving pid; a probe on
  the same host reads it (`read_report_file`). A plaintext shard on another host
  (``--insecure-plaintext``) has no channel and reports nothing.

`probe_shards` attaches each report to the shard's handshake answer (`ProbedShard`);
`shard_adverts` builds every shard's advert from its report (`build_advert`), and a
ranged run negotiates them against this process's pin (`route(..., pin=PIN)`). A shard
that reports another contract version or pin, or nothing, refuses MTP with one line
naming the shard and the difference; plain decoding does not negotiate. The build and the
patch set are reported and recorded (`advert_summary`), not required to match: a patched
client on stock shards is supported (the RPC handshake settles the protocol; the graphs,
and so the cache placement, are the client's).

A report is the shard's claim: mutual TLS proves who claims it, not that it is true.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtplib import pins
from mtplib.contract.capabilities import Policy, RouteRefused, ShardAdvert, build_advert
from mtplib.contract.types import CONTRACT_VERSION
from mtplib.errors import InputError
from mtplib.runtime.routing import PIN, require_mtp, route
from mtplib.runtime.rpc import ShardInfo, parse_endpoint

#: overrides the report directory (tests, or shards and clients sharing another one)
REPORT_DIR_ENV = "MTPLIB_SHARD_REPORTS"
#: the longest report token read (the gateway sends at most gateway.REPORT_MAX)
TOKEN_MAX = 400
BUILDS = ("stock", "patched")

_FIELDS = {
    "contract": re.compile(r"[A-Za-z0-9._/-]{1,40}"),
    "llama-cpp-python": re.compile(r"[A-Za-z0-9.+-]{1,32}"),
    "llama.cpp": re.compile(r"[0-9a-f]{7,40}"),
    "build": re.compile("|".join(BUILDS)),
    "patches": re.compile(r"-|[0-9a-f]{12,64}"),
}
#: fields a report may leave out (a shard of an earlier mtplib): ``device``, the kind of
#: device it serves (`mtplib.runtime.rpc.SHARD_DEVICES`)
_OPTIONAL = {"device": re.compile(r"cpu|gpu")}


class ReportError(InputError):
    """A shard's report that is not one (malformed, oversized, stale)."""


@dataclass(frozen=True)
class ShardReport:
    """A shard's own account of what it runs."""

    contract_version: str
    llama_cpp_python: str
    llama_cpp_commit: str
    build: str
    patch_set: str = ""  # the patch set's sha256 ("" for the stock build)
    #: the device it serves ("cpu" or "gpu"; "" where the shard did not say). A client's
    #: relay answers a CPU shard's allocation-size queries itself (`CountingRelay`)
    device: str = ""

    @property
    def pin(self) -> str:
        """The advert's pin, spelled as `mtplib.runtime.routing.PIN`."""
        return f"llama-cpp-python=={self.llama_cpp_python}@{self.llama_cpp_commit[:9]}"

    def token(self) -> str:
        """One ASCII word (the gateway's status line and the report file carry it)."""
        return ";".join(f"{k}={v}" for k, v in (
            ("contract", self.contract_version), ("llama-cpp-python", self.llama_cpp_python),
            ("llama.cpp", self.llama_cpp_commit), ("build", self.build),
            ("patches", self.patch_set or "-"),
            *((("device", self.device),) if self.device else ())))

    @classmethod
    def parse(cls, token: str) -> ShardReport:
        """The report a token spells; ReportError naming the first fault."""
        if not isinstance(token, str) or not token:
            raise ReportError("empty report")
        if len(token) > TOKEN_MAX or not token.isascii():
            raise ReportError(f"report of {len(token)} characters or not ASCII "
                              f"(at most {TOKEN_MAX} ASCII)")
        items = [part.partition("=") for part in token.split(";")]
        keys = [k for k, _, _ in items]
        required = sorted(k for k in keys if k not in _OPTIONAL)
        if (required != sorted(_FIELDS) or len(set(keys)) != len(keys)
                or any(not sep for _, sep, _ in items)):
            raise ReportError(f"report fields {keys}, expected {list(_FIELDS)} "
                              f"(and optionally {list(_OPTIONAL)})")
        vals = {k: v for k, _, v in items}
        for k, rx in (*_FIELDS.items(), *_OPTIONAL.items()):
            if k in vals and not rx.fullmatch(vals[k]):
                raise ReportError(f"report field {k}={vals[k]!r} is malformed")
        if (vals["build"] == "stock") != (vals["patches"] == "-"):
            raise ReportError(f"report: build {vals['build']} with patches {vals['patches']}")
        return cls(vals["contract"], vals["llama-cpp-python"], vals["llama.cpp"],
                   vals["build"], "" if vals["patches"] == "-" else vals["patches"],
                   vals.get("device", ""))

    def to_dict(self) -> dict:
        return {"contract_version": self.contract_version, "pin": self.pin,
                "build": self.build, "patch_set_sha256": self.patch_set or None,
                "device": self.device or None}


def local_report(device: str = "") -> ShardReport:
    """What this process runs: the upstream library it loaded (its version and build, read
    from the library), this mtplib's contract version and llama.cpp pin, and ``device``, the
    kind of device it serves. Loads upstream (a shard has it loaded already)."""
    from mtplib.runtime.lib import upstream_info

    info = upstream_info()
    return ShardReport(CONTRACT_VERSION, str(info["version"]), pins.LLAMA_CPP_COMMIT,
                       str(info["build"]), info.get("patch_set_sha256") or "", device)


# -- the plaintext channel: a report file per endpoint ---------------------------------
def report_dir() -> Path:
    """$MTPLIB_SHARD_REPORTS, else ``<tmp>/mtplib-shard-reports-<uid>``."""
    env = os.environ.get(REPORT_DIR_ENV)
    return Path(env) if env else Path(tempfile.gettempdir()) / f"mtplib-shard-reports-{os.getuid()}"


def _normal(endpoint: str) -> str:
    host, port = parse_endpoint(endpoint, allow_remote=True)
    return f"{host}:{port}"


def _report_path(endpoint: str) -> Path:
    return report_dir() / (_normal(endpoint).replace(":", "_") + ".json")


def write_report_file(endpoint: str, report: ShardReport) -> Path:
    """Write the serving process's report for ``endpoint`` (atomically; the directory is
    made mode 0700). Returns the file, which the process removes when it stops. ReportError
    where a live process of this user holds it (the port is that one's: this shard will
    not bind it)."""
    path = _report_path(endpoint)
    held = _holder(path)
    if held is not None and held != os.getpid() and _alive(held):
        raise ReportError(f"{path} belongs to the live shard process {held}")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.parent.stat().st_uid != os.getuid():
        raise ReportError(f"report directory {path.parent} is not this user's")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"endpoint": _normal(endpoint), "pid": os.getpid(),
                               "report": report.token()}))
    os.replace(tmp, path)
    return path


def _holder(path: Path) -> int | None:
    """The pid a report file names (None: no file, or not a report)."""
    try:
        return int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_report_file(path: Path) -> None:
    """Remove a report file this process wrote (no error if it is gone)."""
    if _holder(path) == os.getpid():
        with contextlib.suppress(OSError):
            path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_report_file(endpoint: str) -> ShardReport:
    """The report the plaintext shard serving ``endpoint`` on this host wrote; ReportError
    when there is none, it is not this user's, or its process is gone."""
    path = _report_path(endpoint)
    try:
        st = path.stat()
        raw = path.read_text() if st.st_size <= 4 * TOKEN_MAX else ""
    except OSError:
        raise ReportError(f"no report file {path} (not an `mtplib shard serve` on this "
                          "host, or serving through TLS)") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ReportError(f"report file {path} is not this user's alone")
    try:
        rec = json.loads(raw)
        pid, token = int(rec["pid"]), rec["report"]
    except (ValueError, KeyError, TypeError):
        raise ReportError(f"report file {path} is malformed") from None
    if rec.get("endpoint") != _normal(endpoint):
        raise ReportError(f"report file {path} names {rec.get('endpoint')!r}, not {endpoint}")
    if not _alive(pid):
        raise ReportError(f"report file {path} is stale (its process {pid} is gone)")
    return ShardReport.parse(token)


# -- what the probe returns, and the adverts ----------------------------------------------
@dataclass(frozen=True)
class ProbedShard(ShardInfo):
    """A shard's handshake answer and its report (None, with ``report_problem``, where it
    gave none or an unreadable one); ``peer_links``: its TLS gateway's ready line says it
    carries peer links (the ring through the gateways; False for a plaintext shard)."""

    endpoint: str = ""
    report: ShardReport | None = None
    report_problem: str = ""
    peer_links: bool = False


def with_report(info: ShardInfo, endpoint: str, *, token: str | None,
                peer_links: bool = False) -> ProbedShard:
    """``info`` with the shard's report: ``token`` from a gateway's ready line, or (None,
    a plaintext shard) its report file on this host; ``peer_links`` as that line says."""
    base = {f: getattr(info, f) for f in ShardInfo.__dataclass_fields__}
    base["peer_links"] = peer_links
    try:
        if token is None:
            report = read_report_file(endpoint)
        elif not token:
            raise ReportError("its gateway's ready line carries no report")
        else:
            report = ShardReport.parse(token)
    except (ReportError, InputError) as e:
        return ProbedShard(**base, endpoint=endpoint, report_problem=str(e))
    return ProbedShard(**base, endpoint=endpoint, report=report)


#: ``1``: every allocation-size query goes to the shards (as before session 13), none is
#: answered by the client's relays (for side-by-side runs)
FORWARD_ALLOC_SIZES_ENV = "MTPLIB_FORWARD_ALLOC_SIZES"


def answers_alloc_sizes(info: ShardInfo) -> bool:
    """Whether the client's relay answers this shard's allocation-size queries itself:
    the shard reported that it serves its CPU, whose answer the relay knows
    (`mtplib.distributed.relay._AllocSizeAnswers`); not a GPU shard, a shard that reported
    nothing, or with $MTPLIB_FORWARD_ALLOC_SIZES=1."""
    if os.environ.get(FORWARD_ALLOC_SIZES_ENV, "") not in ("", "0"):
        return False
    report, _ = _reported(info)
    return report is not None and report.device == "cpu"


def _reported(info: ShardInfo) -> tuple[ShardReport | None, str]:
    report = getattr(info, "report", None)
    if report is not None:
        return report, ""
    return None, getattr(info, "report_problem", "") or "no report"


def shard_adverts(shards: Sequence[ShardInfo], *, mtp_placed: bool, policy: Policy,
                  certified: Collection[str] = ()) -> list[ShardAdvert]:
    """Every shard's advert from its own report (`build_advert`): its contract version and
    pin as reported ("none reported: why" where it gave none, which negotiation refuses by
    name); the tail's MTP recipes unsupported unless ``mtp_placed`` (the MTP block was
    loaded where its placement says, next to the sampler: the client or the tail)."""
    tail = len(shards) - 1
    out = []
    for i, info in enumerate(shards):
        report, why = _reported(info)
        none = f"none reported: {why}"
        out.append(build_advert(
            i, pin=report.pin if report else "none reported", policy=policy,
            has_mtp_sidecar=mtp_placed and i == tail,
            mtp_problem="" if mtp_placed or i != tail else "no MTP sidecar",
            certified=certified,
            contract_version=report.contract_version if report else none).advert)
    return out


def advert_summary(shards: Sequence[ShardInfo]) -> list[dict]:
    """What each shard reported, as a run's metrics record it (None where nothing)."""
    out = []
    for info in shards:
        report, why = _reported(info)
        out.append({"endpoint": getattr(info, "endpoint", ""),
                    **(report.to_dict() if report else {"report_problem": why})})
    return out


def require_shard_mtp(what: str, shards: Callable[[], Sequence[ShardInfo]], *,
                      policy: Policy | str | None = None) -> Policy:
    """The gate of a path that runs MTP on shards outside RangedMTP (the raw ranged API's
    MTP context): the policy first (before ``shards`` is read), then the shards' own
    adverts against this process's pin; RouteRefused naming ``what``."""
    pol = require_mtp(what, policy=policy)
    try:
        route(1, policy=pol, adverts=shard_adverts(shards(), mtp_placed=True, policy=pol),
              pin=PIN)
    except RouteRefused as e:
        raise RouteRefused(f"{what}: {e}") from None
    return pol
