"""One run's request, built and validated once: `RunRequest`, made by `build_request`.

Why: a run's settings (the draft length, "no sidecar means k = 0", the policy's verdict,
the model files, the shard plan, the endpoints, the WAN links, TLS) were decided again on
several floors (the CLI, `RangedMTP`, `RangedRuntime`, the worker, the engine). Here they
are decided once, where a run starts: `mtplib generate` and `mtplib serve`
(`mtplib.commands.generate.check_engine_args`), `generate_ranged`, the lab's bench and WAN
runs, and `MTPRuntime` / `RangedMTP` / `RangedRuntime` called with keywords all go through
`build_request`; every floor after it reads the frozen object's fields (the ranged worker
gets it pickled, as the object) and checks none of them again. What stays per generation
is only what a generation may change: its own options (another draft length on a loaded
`RangedMTP`), to which the run's policy verdict is applied (`routing.check_policy`).

The seam's rule is here too: a ranged run asks for ``auto`` unless told otherwise
(`DEFAULT_SEAM`), and every entry point (the CLI's --seam, the lanes' ``bench.seam`` and
``wan.seam``, `RangedMTP`, `RangedRuntime`) takes its default from this one name. What
``auto`` becomes is decided against the shards (`resolve_seam` in the ranged runtime: the
ring where this build and every shard speak RPC 7.2 and, under TLS, every shard's gateway
carries peer links, else the star), as is what is decided from costs measured at load (the
``auto`` drafter and head placements: `mtplib.distributed.auto_placement`); the request
keeps what was asked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from mtplib.contract.capabilities import Policy
from mtplib.contract.labels import PLACEMENT_CHOICES, SEAM_CHOICES
from mtplib.contract.types import (
    DEFAULT_DRAFT,
    DSPARK_DRAFTER,
    MAX_DRAFT,
    ContractError,
    DraftRule,
    DraftSpec,
)
from mtplib.errors import InputError
from mtplib.model.dspark.spec import ARCH as DSPARK_ARCH
from mtplib.model.dspark.validate import is_dspark, validate_dspark
from mtplib.model.gguf_header import GGUFHeader
from mtplib.ownership.plan import PlanError, ShardPlan
from mtplib.runtime.engine_options import EngineOptions
from mtplib.runtime.links import WanLink
from mtplib.runtime.settings import DecodeSettings
from mtplib.runtime.tls_config import TlsConfig

log = logging.getLogger(__name__)

#: the seam a ranged run asks for when none is given: ``auto`` = patches/0007's shard-to-shard
#: ring where this build and every shard speak RPC 7.2 and, under TLS, every shard's
#: gateway carries peer links, else the star (through the client); the one default of every
#: entry point
DEFAULT_SEAM = "auto"

#: a run's context size when none is given (`mtplib generate` without --ctx, the lab's WAN
#: runs): min(this, the model's context_length), `default_n_ctx`
DEFAULT_CTX = 2048


class DraftRefused(ContractError):
    """The draft length asked for is none the contract defines (the message names it)."""


def context_length(*models: str | os.PathLike | None) -> int | None:
    """The smallest `context_length` of the given GGUFs, read from their headers before
    anything loads; None when a file cannot be read here (its load reports why)."""
    from mtplib.errors import MtplibError
    from mtplib.model.gguf_header import read_header_fast

    found = []
    for m in models:
        if m is None:
            continue
        try:
            h = read_header_fast(m)
        except (MtplibError, OSError, ValueError):
            return None
        v = h.kv.get(f"{h.arch}.context_length")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return None
        found.append(v)
    return min(found) if found else None


def ctx_default(n_train: int | None, default: int = DEFAULT_CTX) -> int:
    """The context a run gets without one given: min(``default``, the model's
    context_length ``n_train``), or ``default`` where no header says. The CLI's --ctx
    default and the lab's WAN runs (warm and cold start alike) both take it from here."""
    return default if n_train is None else min(default, n_train)


def default_n_ctx(*models: str | os.PathLike | None, default: int = DEFAULT_CTX) -> int:
    """`ctx_default` of the models' smallest context_length (`context_length`)."""
    return ctx_default(context_length(*models), default)


@dataclass(frozen=True)
class RunRequest:
    """Everything one run decided, checked once (`build_request`, the only way to make
    one): downstream reads these fields and validates none of them again.

    ``draft``: the MTP block's drafting, "no sidecar means k = 0" applied (`draft_with`);
    ``draft_rule``: that rule as decided for this run, which a generation's own draft
    length is held to (`EngineOptions.under`) without deciding it again.
    ``opts``: the generations' default options (context settings, head, sampler, trace,
    slots); their k is ``draft.k``, except for a run whose drafts come from the caller's
    own drafter (`MTPRuntime(..., drafter=...)`), where it is that drafter's.
    ``policy``: resolved and asked once (`policy_gate`): a request exists only where the
    policy lets its drafting run. ``plan`` None: the whole model in one process; else the
    shards' layer ranges, ``endpoints`` (None: local shards are started), one ``wan``
    link per shard, the drafter placement as asked (``mtp_placement``), threads per local
    shard, ``tls`` / ``insecure_plaintext`` and ``allow_cache_crossing``. The headers are
    the files' own, read and validated once (the ranged worker reads none)."""

    trunk: str
    sidecar: str | None
    draft: DraftSpec
    opts: EngineOptions
    policy: Policy
    draft_rule: DraftRule
    plan: ShardPlan | None = None
    endpoints: tuple[str, ...] | None = None
    wan: tuple[WanLink, ...] | None = None
    mtp_placement: str = "auto"
    shard_threads: int = 1
    tls: TlsConfig | None = None
    insecure_plaintext: bool = False
    allow_cache_crossing: bool = False
    #: how boundary values reach the next shard (`SEAM_CHOICES`: star, ring, auto; default
    #: `DEFAULT_SEAM`), as asked; the runtime resolves it against the shards' protocol
    #: (`resolve_seam`)
    seam: str = DEFAULT_SEAM
    #: the ring's shard-to-shard links' emulated WAN (`parse_peer_wan`), one per link in
    #: plan order (shard i -> i + 1); None: a peer link gets the longer of its two
    #: shards' ``wan`` links (`default_peer_links`)
    peer_wan: tuple[WanLink, ...] | None = None
    trunk_header: GGUFHeader | None = field(default=None, repr=False, compare=False)
    sidecar_header: GGUFHeader | None = field(default=None, repr=False, compare=False)
    #: what drafts from ``sidecar``, recognised from the file: "mtp" (a deepseek4 `mtp-`
    #: sidecar) or "dspark" (arch `dflash` + `markov_w1`, upstream's draft-dspark)
    sidecar_kind: str = "mtp"

    @property
    def settings(self) -> DecodeSettings:
        """The context and decoding settings (checked when they were made)."""
        return self.opts.settings

    @property
    def head(self) -> str:
        """Where the output head runs, as asked (``auto``: decided at load)."""
        return self.opts.head

    @property
    def ranged(self) -> bool:
        return self.plan is not None

    @property
    def allow_remote(self) -> bool:
        """Non-loopback endpoints are allowed: mutual TLS, or the explicit opt-in."""
        return self.tls is not None or self.insecure_plaintext

    @property
    def headers(self) -> tuple[GGUFHeader | None, GGUFHeader | None]:
        return self.trunk_header, self.sidecar_header

    def with_options(self, **fields: object) -> RunRequest:
        """This request with other generation defaults (sampler, trace, ...): any
        `EngineOptions.build` keyword but the draft length, which the request decided."""
        if "k" in fields:
            raise TypeError("with_options cannot change k: the draft length is the "
                            "request's (build another with build_request)")
        return replace(self, opts=EngineOptions.build(self.opts, **fields))


#: how `build_request`'s errors name each field (the CLI passes its option names)
FIELD_NAMES: Mapping[str, str] = {f: f for f in (
    "draft", "plan", "endpoints", "wan", "mtp_placement", "shard_threads", "tls",
    "insecure_plaintext", "allow_cache_crossing", "seam", "peer_wan")}


def build_request(trunk: str | os.PathLike, *, sidecar: str | os.PathLike | None = None,
                  draft: int | None = None, opts: EngineOptions | None = None,
                  plan: str | ShardPlan | None = None, endpoints: Sequence[str] | None = None,
                  wan: str | Sequence[WanLink] | None = None, mtp_placement: str = "auto",
                  shard_threads: int = 1, tls: TlsConfig | None = None,
                  insecure_plaintext: bool = False, allow_cache_crossing: bool = False,
                  seam: str = DEFAULT_SEAM, peer_wan: str | Sequence[WanLink] | None = None,
                  policy: Policy | str | None = None, own_drafter: bool = False,
                  headers: tuple[GGUFHeader | None, GGUFHeader | None] = (None, None),
                  names: Mapping[str, str] | None = None, **options: object) -> RunRequest:
    """The one function that makes a `RunRequest`, checking every field once, in this
    order (each error an InputError naming the field, as ``names`` spells it):

    1. the draft length: ``draft`` (or ``k=`` / ``opts.k``; default DEFAULT_DRAFT, for a
       DSpark draft its block size, to which a longer one is clamped), with "no sidecar
       means k = 0" decided (`draft_with`, once); DraftRefused names it;
    2. the policy's verdict (`policy_gate`, once): MTP under a policy that disables it is
       refused here, before any file is read or shard started;
    3. the files: each header read once and validated (the pair check validates both; a
       DSpark draft, arch `dflash`, is validated against the trunk: ``sidecar_kind``);
    4. ranged (``plan`` given): the plan parsed against the trunk's layers, the endpoints
       checked against it (`check_endpoints`) and each one's address, one WAN link per
       shard (`parse_wan`), the drafter placement, the local shards' threads, the seam
       (default `DEFAULT_SEAM`) and the ring's peer links' WAN (`parse_peer_wan`, only
       where a relay here carries them). Without a plan none of the shard fields may be
       given (the seam only as its default).

    ``options``: any `EngineOptions` or `DecodeSettings` field (`EngineOptions.build`)
    on top of ``opts``. ``own_drafter``: the caller drafts with its own drafter, so the
    options keep their k even without a sidecar (``draft`` is still the MTP block's).
    ``headers``: the files' headers where the caller read them already."""
    from mtplib.contract import types
    from mtplib.runtime import routing

    name = {**FIELD_NAMES, **(names or {})}.get
    # 1. the draft length, checked and "no sidecar means k=0" decided, once
    if draft is not None and "k" in options:
        raise TypeError("give draft or k, not both")
    asked = draft if draft is not None else options.pop("k", None)
    dspark_max = dspark_draft_max(sidecar, headers[1])  # None: not a DSpark draft
    if asked is None:
        # a DSpark draft drafts its block by default (upstream's n_max, clamped below)
        asked = opts.k if opts is not None else DEFAULT_DRAFT if dspark_max is None \
            else dspark_max
    has_sidecar = sidecar is not None
    rule = DraftRule(has_sidecar)  # carried: the run's generations are held to it
    try:
        if own_drafter:
            k = types.checked_draft(asked, name("draft"))
            spec = DraftSpec(types.draft_with(k, has_sidecar=has_sidecar))
        else:
            spec = DraftSpec(types.draft_with(asked, has_sidecar=has_sidecar,
                                              name=name("draft")))
            k = spec.k
    except ContractError as e:
        raise DraftRefused(str(e)) from None
    if dspark_max is not None and spec.k > dspark_max and not own_drafter:
        # upstream clamps n_max the same way (common/speculative.cpp:1016-1022)
        log.warning("draft length %d exceeds the DSpark block size: clamped to %d",
                    spec.k, dspark_max)
        spec = DraftSpec(dspark_max)
        k = spec.k
    if dspark_max is not None and not own_drafter:  # the contract's dspark.v4.draft<k>
        spec = DraftSpec(spec.k, DSPARK_DRAFTER)
    base = opts if opts is not None else EngineOptions(k=k)
    run_opts = EngineOptions.build(base, k=k, **options)
    # 2. the policy's verdict, before anything is read, loaded or started
    pol = routing.policy_gate(spec, policy)
    # 3. the files, each read and validated once
    th, sh = _headers(trunk, sidecar, headers)
    kind = "dspark" if sh is not None and is_dspark(sh) else "mtp"
    req = dict(trunk=str(trunk), sidecar=None if sidecar is None else str(sidecar),
               draft=spec, opts=run_opts, policy=pol, draft_rule=rule, trunk_header=th,
               sidecar_header=sh, sidecar_kind=kind)
    if run_opts.p_min and kind != "dspark":
        raise InputError("p_min (--draft-p-min) applies to DSpark drafting only (a DSpark "
                         "draft's confidence head); the MTP block drafts k tokens every step")
    # 4. the shards
    if plan is None:
        given = [name(f) for f, v in (("endpoints", endpoints is not None),
                                      ("wan", wan is not None and str(wan).strip() != ""),
                                      ("mtp_placement", mtp_placement != "auto"),
                                      ("tls", tls is not None),
                                      ("insecure_plaintext", insecure_plaintext),
                                      ("allow_cache_crossing", allow_cache_crossing),
                                      ("seam", seam != DEFAULT_SEAM),
                                      ("peer_wan", peer_wan is not None
                                       and str(peer_wan).strip() != "")) if v]
        if given:
            raise InputError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                             f"{name('plan')}: they describe shards (a whole-model run has "
                             "none)")
        return RunRequest(**req)
    if kind == "dspark" and mtp_placement == "tail":  # the client's placement is built
        raise InputError(f"{name('mtp_placement')} tail: DSpark on the tail shard is not "
                         "built yet (docs/shards-and-tls.md); use client or auto")
    return RunRequest(**req, **_shards(
        th, plan, endpoints, wan, mtp_placement, shard_threads, tls, insecure_plaintext,
        allow_cache_crossing, seam, peer_wan, name))


def dspark_draft_max(sidecar, header: GGUFHeader | None) -> int | None:
    """The most drafts a DSpark ``sidecar`` gives per step (anchor-first: its block size,
    within the contract's bound), or None when it is not a DSpark draft or cannot be read
    here (the file check that follows says why)."""
    from mtplib.errors import MtplibError
    from mtplib.model.gguf_header import read_header_fast

    if sidecar is None:
        return None
    try:
        h = header or read_header_fast(sidecar)
    except (MtplibError, OSError, ValueError):
        return None
    if not is_dspark(h):
        return None
    b = h.kv.get(DSPARK_ARCH + ".block_size")
    if not isinstance(b, int) or isinstance(b, bool) or b < 1:
        return None  # refused by the file check, naming the key
    return min(b, MAX_DRAFT)


def _headers(trunk, sidecar, given) -> tuple[GGUFHeader, GGUFHeader | None]:
    """Both files' headers, each read once (unless given) and validated once: the pair
    check validates both; a trunk alone is checked on its own."""
    from mtplib.model.gguf_header import read_header, require_deepseek4
    from mtplib.model.validate import validate_header
    from mtplib.runtime.model import check_pair

    th, sh = given
    th = th or read_header(trunk)
    if sidecar is not None:
        sh = sh or read_header(sidecar)
        if sh.arch == DSPARK_ARCH:  # a DSpark draft: checked against the trunk
            require_deepseek4(th)
            validate_header(th)
            validate_dspark(sh, th)
            return th, sh
        check_pair(th, sh)
    else:
        sh = None
        require_deepseek4(th)
        validate_header(th)
    return th, sh


def _shards(th: GGUFHeader, plan, endpoints, wan, mtp_placement: str, shard_threads: int,
            tls, insecure_plaintext: bool, allow_cache_crossing: bool, seam: str,
            peer_wan, name) -> dict:
    """A ranged request's shard fields, each checked once."""
    from mtplib.ownership import plan as plans
    from mtplib.runtime.links import parse_wan
    from mtplib.runtime.model import check_threads
    from mtplib.runtime.rpc import parse_endpoint

    n_layer = int(th.kv["deepseek4.block_count"])
    if isinstance(plan, str):
        if not plan.strip():
            raise PlanError(f"{name('plan')} is empty: give layer ranges like 0-1,2-3, or "
                            "leave it out to run the whole model")
        try:
            shard_plan = ShardPlan.parse(plan, n_layer)
        except PlanError as e:
            raise PlanError(f"{name('plan')} {plan!r}: {e}") from None
    elif isinstance(plan, ShardPlan):
        if plan.n_layer != n_layer:
            raise PlanError(f"{name('plan')} {plan} covers layers 0-{plan.n_layer - 1}, the "
                            f"trunk has {n_layer} (0-{n_layer - 1})")
        shard_plan = plan
    else:
        raise InputError(f"{name('plan')} must be layer ranges (e.g. '0-1,2-3') or a "
                         f"ShardPlan, got {type(plan).__name__}")
    eps = None
    if endpoints is not None:
        if isinstance(endpoints, str) or not all(isinstance(e, str) for e in endpoints):
            raise InputError(f"{name('endpoints')} must be a list of HOST:PORT strings, got "
                             f"{endpoints!r}")
        eps = tuple(plans.check_endpoints(shard_plan, endpoints))
        for e in eps:
            parse_endpoint(e, allow_remote=tls is not None or insecure_plaintext)
    if wan is None or isinstance(wan, str):
        links = tuple(parse_wan(wan, shard_plan.n_shards))
    else:
        links = tuple(wan)
        if not all(isinstance(w, WanLink) for w in links):
            raise InputError(f"{name('wan')} must be RTT_MS[:MBIT],... or WanLinks, got "
                             f"{wan!r}")
        if len(links) != shard_plan.n_shards:
            raise InputError(f"{name('wan')}: {len(links)} WAN links for "
                             f"{shard_plan.n_shards} shards")
    if mtp_placement not in PLACEMENT_CHOICES:
        raise InputError(f"{name('mtp_placement')} must be one of "
                         f"{', '.join(PLACEMENT_CHOICES)}, got {mtp_placement!r}")
    check_threads(shard_threads, name("shard_threads"))
    if seam not in SEAM_CHOICES:
        raise InputError(f"{name('seam')} must be one of {', '.join(SEAM_CHOICES)}, got "
                         f"{seam!r}")
    if tls is not None and not isinstance(tls, TlsConfig):
        raise InputError(f"{name('tls')} must be a TlsConfig (TlsConfig.load(DIR)), got "
                         f"{type(tls).__name__}")
    peers = _peer_wan(peer_wan, shard_plan.n_shards, eps, tls, name)
    return dict(plan=shard_plan, endpoints=eps, wan=links, peer_wan=peers,
                mtp_placement=mtp_placement, shard_threads=shard_threads, tls=tls,
                insecure_plaintext=bool(insecure_plaintext),
                allow_cache_crossing=bool(allow_cache_crossing), seam=str(seam))


def _peer_wan(peer_wan, n_shards: int, eps, tls, name) -> tuple[WanLink, ...] | None:
    """The peer links' WAN, checked once: one link per shard pair, each emulated by the
    relay of the shard it pushes into, so that shard must be reached through a relay on
    this host (a local shard or a loopback endpoint; a remote shard is dialled directly
    by the shard before it) and the gateways must not be between them (no TLS)."""
    from mtplib.runtime.links import parse_peer_wan
    from mtplib.runtime.rpc import parse_endpoint

    if peer_wan is None or (isinstance(peer_wan, str) and not peer_wan.strip()):
        return None
    if isinstance(peer_wan, str):
        links = tuple(parse_peer_wan(peer_wan, n_shards, option=name("peer_wan")))
    else:
        links = tuple(peer_wan)
        if not all(isinstance(w, WanLink) for w in links):
            raise InputError(f"{name('peer_wan')} must be RTT_MS[:MBIT],... or WanLinks, got "
                             f"{peer_wan!r}")
        if len(links) != n_shards - 1:
            raise InputError(f"{name('peer_wan')}: {len(links)} WAN links for "
                             f"{n_shards - 1} peer links ({n_shards} shards)")
    if tls is not None:
        raise InputError(f"{name('peer_wan')} emulates plain peer links only (under "
                         f"{name('tls')} a peer link passes this client's relay only where "
                         f"this host holds the shard certificate; leave out {name('tls')})")
    for i, e in enumerate(eps or ()):
        if i and not parse_endpoint(e, allow_remote=True)[0].startswith("127."):
            raise InputError(f"{name('peer_wan')}: shard {i} at {e} is remote, so the shard "
                             "before it dials it directly and no relay here can delay that "
                             f"link; {name('peer_wan')} emulates peer links between local "
                             "or loopback shards")
    return links
