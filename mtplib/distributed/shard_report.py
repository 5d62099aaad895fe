"""What each shard says it runs, and the adverts a ranged run routes on, built from that.

Why: upstream's RPC protocol carries a protocol version and device facts only, so the
client cannot learn there which mtplib contract, llama-cpp-python / llama.cpp pin, build
(stock or patched) and patch set a shard runs; adverts the client built from its own pin
could never fail the pin or contract checks. So every ``mtplib shard serve`` process
reports its own (`local_report`, from the upstream library it loaded) **in band**: its
front (the plaintext `PlainFront` or the TLS `Gateway`) answers mtplib's report request
on the very endpoint the client dials (`mtplib.distributed.report_wire`), so a TCP
forward, an SSH tunnel, a container port mapping or NAT in between changes nothing.
Upstream's own RPC server (a stock shard, or a forward to one) closes a connection that
does not open with HELLO: that shard reports nothing.

`probe_shards` asks every shard for its report, then does upstream's handshake, and
attaches the report to the handshake answer (`ProbedShard`); `shard_adverts` builds every
shard's advert from its report (`build_advert`), and a ranged run negotiates them against
this process's pin (`route(..., pin=PIN)`). A shard that reports another contract version
or pin, or nothing, refuses MTP with one line naming the shard and the difference; plain
decoding does not negotiate. The build and the patch set are reported and recorded
(`advert_summary`), not required to match: a patched client on stock shards is supported
(the RPC handshake settles the protocol; the graphs, and so the cache placement, are the
client's).

A report is the shard's claim (and, in plaintext, whatever answers on its endpoint): mutual
TLS proves who claims it, not that it is true.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from mtplib import envs, pins
from mtplib.contract.capabilities import Policy, RouteRefused, ShardAdvert, build_advert
from mtplib.contract.types import CONTRACT_VERSION
from mtplib.errors import InputError
from mtplib.runtime.routing import PIN, require_mtp, route
from mtplib.runtime.rpc import ShardInfo

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
    """A shard's report that is not one (missing, malformed, oversized)."""


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

    def fields(self) -> dict[str, str]:
        """The report as the wire carries it (`mtplib.distributed.report_wire`): each
        field's name and its ASCII value ("-": no patch set; no ``device`` if unsaid)."""
        out = {"contract": self.contract_version, "llama-cpp-python": self.llama_cpp_python,
               "llama.cpp": self.llama_cpp_commit, "build": self.build,
               "patches": self.patch_set or "-"}
        if self.device:
            out["device"] = self.device
        return out

    @classmethod
    def from_fields(cls, fields: Mapping) -> ShardReport:
        """The report ``fields`` spell (as `fields` writes them); ReportError naming the
        first fault (a field missing, unknown, not a string, or malformed)."""
        if not isinstance(fields, Mapping):
            raise ReportError(f"a report is an object of fields, got {type(fields).__name__}")
        keys = sorted(str(k)[:40] for k in fields)
        required = sorted(str(k) for k in fields if k not in _OPTIONAL)
        if required != sorted(_FIELDS):
            raise ReportError(f"report fields {keys[:12]}, expected {list(_FIELDS)} "
                              f"(and optionally {list(_OPTIONAL)})")
        for k, rx in (*_FIELDS.items(), *_OPTIONAL.items()):
            v = fields.get(k)
            if k in fields and not (isinstance(v, str) and v.isascii() and rx.fullmatch(v)):
                raise ReportError(f"report field {k}={v!r:.80} is malformed")
        if (fields["build"] == "stock") != (fields["patches"] == "-"):
            raise ReportError(f"report: build {fields['build']} with patches "
                              f"{fields['patches']}")
        return cls(fields["contract"], fields["llama-cpp-python"], fields["llama.cpp"],
                   fields["build"], "" if fields["patches"] == "-" else fields["patches"],
                   fields.get("device", ""))

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


# -- what the probe returns, and the adverts ----------------------------------------------
@dataclass(frozen=True)
class ProbedShard(ShardInfo):
    """A shard's handshake answer and its report (None, with ``report_problem``, where it
    gave none or an unreadable one: `mtplib.distributed.report_wire`); ``peer_links``: its
    TLS gateway's ready line says it carries peer links (the ring through the gateways;
    False for a plaintext shard)."""

    endpoint: str = ""
    report: ShardReport | None = None
    report_problem: str = ""
    peer_links: bool = False


def with_report(info: ShardInfo, endpoint: str, *, report: ShardReport | None,
                problem: str = "", peer_links: bool = False) -> ProbedShard:
    """``info`` (the handshake's answer) with what the shard answered mtplib's report
    request: ``report``, or None and ``problem`` (why there is none); ``peer_links`` as its
    gateway's ready line says."""
    base = {f: getattr(info, f) for f in ShardInfo.__dataclass_fields__}
    return ProbedShard(**base, endpoint=endpoint, report=report,
                       report_problem="" if report is not None else problem or "no report",
                       peer_links=peer_links)


#: ``1``: every allocation-size query goes to the shards (as before session 13), none is
#: answered by the client's relays (for side-by-side runs)
FORWARD_ALLOC_SIZES_ENV = envs.FORWARD_ALLOC_SIZES


def answers_alloc_sizes(info: ShardInfo) -> bool:
    """Whether the client's relay answers this shard's allocation-size queries itself:
    the shard reported that it serves its CPU, whose answer the relay knows
    (`mtplib.distributed.relay._AllocSizeAnswers`); not a GPU shard, a shard that reported
    nothing, or with $MTPLIB_FORWARD_ALLOC_SIZES=1."""
    if envs.forward_alloc_sizes():
        return False
    report, _ = _reported(info)
    return report is not None and report.device == "cpu"


def _reported(info: ShardInfo) -> tuple[ShardReport | None, str]:
    report = getattr(info, "report", None)
    if report is not None:
        return report, ""
    return None, getattr(info, "report_problem", "") or "no report"


def shard_adverts(shards: Sequence[ShardInfo], *, mtp_placed: bool, policy: Policy,
                  certified: Collection[str] = (), dspark_block: int = 0
                  ) -> list[ShardAdvert]:
    """Every shard's advert from its own report (`build_advert`): its contract version and
    pin as reported ("none reported: why" where it gave none, which negotiation refuses by
    name); the tail's MTP recipes unsupported unless ``mtp_placed`` (the MTP block was
    loaded where its placement says, next to the sampler: the client or the tail).
    DSpark recipes: unsupported on every shard unless ``dspark_block`` > 0, the block size
    of a DSpark draft the run loaded where its placement says (only the client placement
    is built; `mtplib.runtime.request` refuses the tail one); then the tail's advert holds
    it, as for MTP. Shards hold no draft file (the client uploads the weights); which
    drafters a shard can serve follows from the contract version it reports."""
    tail = len(shards) - 1
    out = []
    for i, info in enumerate(shards):
        report, why = _reported(info)
        none = f"none reported: {why}"
        out.append(build_advert(
            i, pin=report.pin if report else "none reported", policy=policy,
            has_mtp_sidecar=mtp_placed and i == tail,
            mtp_problem="" if mtp_placed or i != tail else "no MTP sidecar",
            certified=certified, has_dspark_draft=dspark_block > 0 and i == tail,
            dspark_block=dspark_block,
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
