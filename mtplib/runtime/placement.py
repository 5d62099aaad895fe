"""Where the MTP drafter and the output head run, decided from measured costs (issue 29
item 4): ``--mtp-placement auto`` and ``--head auto`` of a ranged run.

Why: the drafter in the client costs no round trip but runs on the client's CPU (V4-Flash's
MTP block and head: 119.8 ms of one core's CPU time per draft, evidence/layer-cost); on the
tail shard it runs next to the trunk's last layers but each drafted token waits on the tail
link. Neither wins everywhere, so ``auto`` compares the two per verify cycle (one verify
step and its k drafts) from what this run measured: the client's draft and head time on
this host, the tail's, and the tail link's round trip. Pure Python: the runtime measures,
this module only decides, so the decision is testable with any costs.

The cost model, per cycle of k drafted tokens (waits: round trips to the tail, today's
code, measured on the trained pair: evidence/placement/README.md):

    drafter in the client:  k x client_draft_s
    drafter on the tail:    k x (tail_draft_s + draft_waits x rtt) + feed_waits x rtt
    head in the client:     (k+1) x client_head_s + rows_bytes / bandwidth
    head upstream (tail):   (k+1) x tail_head_s + head_waits x rtt + logits_bytes / bandwidth

Feeding the drafter (the accepted rows, batched) is not modelled: it runs where the drafter
runs and costs about one draft decode on either side. Bytes count only where the link's
bandwidth is known (an emulated cap); a real link's bandwidth is not measured here.
Ties go to today's defaults: the drafter in the client; the head in the client with MTP
on, upstream's with MTP off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from mtplib.contract.labels import Placement
from mtplib.errors import InputError

#: waits on the tail per drafted token with the drafter on the tail, by where the head runs
#: (draft waits per draft step / k: 1.875 / 2 with either head; trained pair, plan 0-1,2-3,
#: k=2, 16 tokens after a warm-up, patches 0001-0006: evidence/placement/waits.json)
DRAFT_WAITS_PER_TOKEN = {"upstream": 1.875 / 2, "client": 1.875 / 2}
#: waits per verify step of the feed with the drafter on the tail (same run: 0)
FEED_WAITS_PER_STEP = 0.0
#: extra waits per verify step with the head upstream rather than in the client, by where
#: the drafter runs (same run: 2.0 vs 2.0 either way, one per shard); with MTP off both
#: heads wait once per shard
HEAD_EXTRA_WAITS = {Placement.CLIENT.value: 0.0, Placement.TAIL.value: 0.0}
WAITS_SOURCE = ("waits per step counted by the relays, trained pair, plan 0-1,2-3, k=2, "
                "patches 0001-0006 (evidence/placement/waits.json)")
#: the costs a caller may force (`PlacementInputs.forced`), in seconds
COST_FIELDS = ("client_draft_s", "tail_draft_s", "client_head_s", "tail_head_s", "rtt_s")


@dataclass(frozen=True)
class PlacementInputs:
    """What the decision takes; every cost in seconds, each with its source in ``sources``
    ("measured ...", "estimated ...", "given"). Per drafted token: client_draft_s (the MTP
    block and its head in this process), tail_draft_s (compute only: the waits are added
    from ``rtt_s``). Per row: client_head_s, tail_head_s (the trunk's output head). rtt_s:
    one round trip on the tail's link. bandwidth_bps: the tail link's, None when unknown.
    row_bytes / logits_bytes: one hidden row (hc*n_embd f32) / one row of logits."""

    k: int
    rtt_s: float
    client_draft_s: float | None = None
    tail_draft_s: float | None = None
    client_head_s: float | None = None
    tail_head_s: float | None = None
    bandwidth_bps: float | None = None
    row_bytes: int = 0
    logits_bytes: int = 0
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise InputError(f"k must be an int >= 0, got {self.k!r}")
        for name in (*COST_FIELDS, "bandwidth_bps"):
            v = getattr(self, name)
            if v is None and name != "rtt_s":
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0 or (name == "bandwidth_bps" and v == 0):
                raise InputError(f"{name} must be a finite number of seconds >= 0"
                                 f"{' (bits/s > 0)' if name == 'bandwidth_bps' else ''}, "
                                 f"got {v!r}")

    def forced(self, costs: Mapping[str, float] | None) -> PlacementInputs:
        """These inputs with ``costs`` (seconds, names in COST_FIELDS) replacing the
        measured ones, each marked "given"; InputError for an unknown name."""
        if not costs:
            return self
        unknown = set(costs) - set(COST_FIELDS)
        if unknown:
            raise InputError(f"unknown placement costs {sorted(unknown)}; known: "
                             f"{', '.join(COST_FIELDS)}")
        return replace(self, **{k: float(v) for k, v in costs.items()},
                       sources={**self.sources, **dict.fromkeys(costs, "given")})


@dataclass(frozen=True)
class Choice:
    """One decision: the option chosen, each option's modelled seconds per verify cycle,
    and why (a missing input decides for the default, and says so)."""

    what: str
    chosen: str
    cost_s: dict[str, float | None]
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def _bytes_s(n: float, bw: float | None) -> float:
    return 0.0 if bw is None else n * 8 / bw


def choose_placement(inp: PlacementInputs, *, head: str = "client") -> Choice:
    """Where the MTP drafter runs (`Placement`), from the costs of one verify cycle; the
    client on a tie, or when the client's or the tail's draft cost is unknown."""
    if inp.k == 0:
        return Choice("mtp_placement", Placement.CLIENT, {}, "k = 0: nothing is drafted")
    waits = DRAFT_WAITS_PER_TOKEN.get(head, DRAFT_WAITS_PER_TOKEN["client"])
    client = None if inp.client_draft_s is None else inp.k * inp.client_draft_s
    tail = None if inp.tail_draft_s is None else (
        inp.k * (inp.tail_draft_s + waits * inp.rtt_s) + FEED_WAITS_PER_STEP * inp.rtt_s)
    costs = {Placement.CLIENT.value: client, Placement.TAIL.value: tail}
    if client is None or tail is None:
        return Choice("mtp_placement", Placement.CLIENT, costs,
                      "a draft cost is unknown: the client (no round trip per draft)")
    if tail < client:
        return Choice("mtp_placement", Placement.TAIL, costs,
                      f"the tail drafts {inp.k} tokens in {tail * 1e3:.3g} ms with "
                      f"{waits:g} waits each at {inp.rtt_s * 1e3:.3g} ms RTT, the client in "
                      f"{client * 1e3:.3g} ms")
    return Choice("mtp_placement", Placement.CLIENT, costs,
                  f"the client drafts {inp.k} tokens in {client * 1e3:.3g} ms, the tail in "
                  f"{tail * 1e3:.3g} ms ({waits:g} waits per token at "
                  f"{inp.rtt_s * 1e3:.3g} ms RTT)")


def choose_head(inp: PlacementInputs, *, placement: str = Placement.CLIENT) -> Choice:
    """Where the trunk's output head runs ("client" or "upstream", as EngineOptions.head),
    from the costs of one verify step of k+1 rows (a plain step with k = 0). The client's
    head needs its time measured; without it, or on a tie, today's default."""
    rows = inp.k + 1
    default = "client" if inp.k else "upstream"
    extra = HEAD_EXTRA_WAITS.get(str(placement), 0.0) if inp.k else 0.0
    # the drafter in the client needs the rows either way: upstream's head adds the logits
    drafter_rows = inp.k > 0 and placement == Placement.CLIENT
    up_bytes = rows * (inp.logits_bytes + (inp.row_bytes if drafter_rows else 0))
    client = None if inp.client_head_s is None else (
        rows * inp.client_head_s + _bytes_s(rows * inp.row_bytes, inp.bandwidth_bps))
    up = None if inp.tail_head_s is None else (
        rows * inp.tail_head_s + extra * inp.rtt_s + _bytes_s(up_bytes, inp.bandwidth_bps))
    costs = {"client": client, "upstream": up}
    if client is None or up is None:
        return Choice("head", default, costs, f"a head cost is unknown: {default} (the "
                      "default for MTP " + ("on)" if inp.k else "off)"))
    win = default if math.isclose(client, up, rel_tol=1e-9) else (
        "client" if client < up else "upstream")
    bw = ("bandwidth not known: bytes not counted" if inp.bandwidth_bps is None
          else f"{inp.bandwidth_bps / 1e6:g} Mbit/s")
    return Choice("head", win, costs, f"{win}: client {client * 1e3:.3g} ms, upstream "
                  f"{up * 1e3:.3g} ms per step of {rows} rows ({extra:g} extra waits at "
                  f"{inp.rtt_s * 1e3:.3g} ms RTT; {bw})")


def break_even_rtt_s(client_draft_s: float, tail_draft_s: float, *,
                     head: str = "client") -> float | None:
    """The RTT below which the tail's drafter wins (None: never, it is not faster)."""
    waits = DRAFT_WAITS_PER_TOKEN.get(head, DRAFT_WAITS_PER_TOKEN["client"])
    if tail_draft_s >= client_draft_s:
        return None
    return (client_draft_s - tail_draft_s) / (waits + FEED_WAITS_PER_STEP)


def decision_record(inp: PlacementInputs, *, placement: Choice | None,
                    head: Choice | None, requested: Mapping[str, str]) -> dict:
    """What a run's ``routing`` records about its placement: what was asked, the inputs
    (with their sources) and each decision ``auto`` made."""
    inputs = {k: v for k, v in asdict(inp).items() if k != "sources"}
    return {"requested": dict(requested), "inputs": inputs, "sources": dict(inp.sources),
            "waits": {"draft_per_token": DRAFT_WAITS_PER_TOKEN,
                      "feed_per_step": FEED_WAITS_PER_STEP,
                      "head_extra_per_verify": HEAD_EXTRA_WAITS, "source": WAITS_SOURCE},
            "decisions": {c.what: c.as_dict() for c in (placement, head) if c is not None}}
