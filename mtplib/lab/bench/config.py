"""The benchmark's configuration: a lane's ``bench:`` section (`BenchConfig`), checked before
anything runs, and what it requires of the build (`check_requirements`). The runs are
`mtplib.lab.bench`'s; a bad section fails here with one line naming the key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtplib.contract.capabilities import POLICIES, RouteRefused
from mtplib.contract.labels import SEAM_CHOICES
from mtplib.errors import InputError, UpstreamFault
from mtplib.lab.common import checks as C
from mtplib.lab.common.acceptance_sweep import SWEEP_RULES, SweepConfig
from mtplib.runtime.links import WanLink, parse_wan
from mtplib.runtime.request import DEFAULT_SEAM
from mtplib.runtime.routing import resolve_policy, route
from mtplib.runtime.settings import DecodeSettings


class BenchConfigError(InputError):
    """A malformed ``bench:`` section."""


# -- configuration ----------------------------------------------------------------------
@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 0.95
    seeds: int = 4
    n_new: int = 16


#: each `SamplingConfig` field's one rule (a lane's ``bench.sampling``)
SAMPLING_RULES: dict[str, C.Check] = {
    "temperature": C.number(0, C.MAX_TEMPERATURE),
    "top_p": C.number(0, 1),
    "seeds": C.integer(1, C.MAX_REPEATS),
    "n_new": C.integer(1, C.MAX_NEW_TOKENS),
}
#: each `BenchConfig` field's one rule: `BenchConfig.validate` checks the section with it
#: (strict; ``sweep`` and ``sampling`` field by field with `NESTED`), and
#: `mtplib.records.parameters` a lane's ``bench:`` and notebook 04's ``bench`` (lenient)
BENCH_RULES: dict[str, C.Check] = {
    "ks": C.drafts(1),
    "plans": C.plans(whole=True),
    "prompts": C.list_of(C.prompt(), what="prompts", max_len=C.MAX_REPEATS),
    "n_new": C.integer(2, C.MAX_NEW_TOKENS),
    "reps": C.integer(1, C.MAX_REPEATS),
    "warmup": C.integer(0, C.MAX_REPEATS),
    "threads": C.optional(C.threads()),
    "n_ctx": C.context_size(),
    "backend": C.text(("cpu", "gpu")),
    "sweep": C.optional(C.section(SweepConfig, SWEEP_RULES), none=(None, False)),
    "sampling": C.optional(C.section(SamplingConfig, SAMPLING_RULES)),
    "policy": C.optional(C.text(tuple(POLICIES))),
    "wan": C.optional(C.text(what="RTT_MS[:MBIT][,...] (as generate --wan)")),
    "tls": C.optional(C.says(C.text(what="a TLS directory (mtplib tls init DIR)"),
                             "a directory (mtplib tls init DIR)")),
    "seam": C.text(SEAM_CHOICES),
}
#: the nested sections' rules, for `C.check_fields`
NESTED = {"sweep": SWEEP_RULES, "sampling": SAMPLING_RULES}


@dataclass
class BenchConfig:
    """The ``bench:`` section of a lane (every key optional)."""

    ks: list[int] = field(default_factory=lambda: [1, 2, 3])
    plans: list[str] = field(default_factory=lambda: ["whole"])
    #: each prompt: a text (tokenized by the trunk) or {seed: N, len: L} (random token ids)
    prompts: list = field(default_factory=lambda: [{"seed": 0, "len": 12}])
    n_new: int = 48
    reps: int = 3
    warmup: int = 1
    threads: int | None = None  # None: the lane's threads
    n_ctx: int = 512
    backend: str = "cpu"  # cpu | gpu (a gpu lane stops cleanly on a build without a GPU)
    sweep: SweepConfig | None = field(default_factory=SweepConfig)
    sampling: SamplingConfig | None = None
    #: deployment policy (a name; None: the lane's, else $MTPLIB_POLICY, else beta). The
    #: bench compares MTP off with on: under a policy that disables MTP (alpha) it refuses
    #: to run (`check_requirements`) instead of measuring MTP off alone.
    policy: str | None = None
    #: ranged plans only: the emulated WAN in front of each shard, as `generate --wan`
    #: ("RTT_MS[:MBIT]" for every shard, or one per shard, comma-separated); None: loopback
    wan: str | None = None
    #: ranged plans only: a TLS directory (`mtplib tls init`): the local shards serve through
    #: their mutual-TLS gateways and the relays connect with TLS, as `generate --tls`
    tls: str | None = None
    #: ranged plans only: how boundary values reach the next shard, as `generate --seam`
    #: (`SEAM_CHOICES`: star, ring = patches/0007's shard to shard, auto; default the
    #: request's, `DEFAULT_SEAM`); each ranged row says which ran and why, per shard pair
    #: (``seam``)
    seam: str = DEFAULT_SEAM

    @classmethod
    def from_dict(cls, d: dict | None, *, threads: int | None = None,
                  policy: str | None = None) -> BenchConfig:
        d = dict(d or {})
        if policy is not None and d.get("policy") not in (None, policy):
            raise BenchConfigError(f"bench: policy {d['policy']!r} differs from the lane's "
                                   f"policy {policy!r}")
        if policy is not None:
            d["policy"] = policy
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise BenchConfigError(f"bench: unknown keys {sorted(unknown)} "
                                   f"(known: {sorted(known)})")
        sweep = d.pop("sweep", {})
        sampling = d.pop("sampling", None)
        try:
            cfg = cls(**d)
            cfg.sweep = None if sweep is None or sweep is False else _sub(SweepConfig, sweep)
            cfg.sampling = None if not sampling else _sub(SamplingConfig, sampling)
        except TypeError as e:
            raise BenchConfigError(f"bench: {e}") from None
        if cfg.threads is None:
            cfg.threads = threads or 2
        try:
            cfg.policy = resolve_policy(cfg.policy).name
        except InputError as e:
            raise BenchConfigError(f"bench: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Each field by its one rule (`BENCH_RULES`), then ``wan`` parsed and the TLS
        files read, before anything runs."""
        C.check_fields(self, BENCH_RULES, "bench", nested=NESTED, error=BenchConfigError)
        self._wan_links = self._parse_wan()
        self._tls = self._load_tls()  # a missing file stops the bench before anything runs

    def _parse_wan(self) -> dict[str, tuple[WanLink, ...]]:
        """``wan`` parsed once, here, for every ranged plan (one link per shard): a
        malformed value stops the bench before anything runs, and each plan's request
        gets these links (`wan_links`), not the text to parse again."""
        return {plan: tuple(parse_wan(self.wan, len(plan.split(","))))
                for plan in self.plans if plan != "whole"}

    def wan_links(self, plan: str) -> tuple[WanLink, ...]:
        """The WAN links of a ranged ``plan``, as `validate` parsed them (a config that
        was not validated has none: use `from_dict`)."""
        links = getattr(self, "_wan_links", None)
        if links is None or plan not in links:
            raise BenchConfigError(f"bench: no WAN links for plan {plan!r}: the config was "
                                   "not validated with it (BenchConfig.from_dict)")
        return links[plan]

    def tls_config(self):
        """The `TlsConfig` of ``tls`` as `validate` loaded and checked it, once (None
        without it; a config that was not validated loads it here)."""
        if not hasattr(self, "_tls"):
            self._tls = self._load_tls()
        return self._tls

    def _load_tls(self):
        """The `TlsConfig` of ``tls`` with both sides' files checked (None without it)."""
        if self.tls is None:
            return None
        from mtplib.distributed.tls import TlsConfig

        try:
            cfg = TlsConfig.load(self.tls)
            cfg.server_context()
            cfg.client_context()
        except InputError as e:
            raise BenchConfigError(f"bench: tls: {e}") from None
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

    def settings(self) -> DecodeSettings:
        """The context every run of the bench gets: the section's n_ctx and threads, the
        C API's defaults otherwise (the section keeps its keys; lanes write them)."""
        return DecodeSettings(n_ctx=self.n_ctx, n_threads=int(self.threads))


def _sub(cls, d: dict):
    if not isinstance(d, dict):
        raise BenchConfigError(f"bench: expected a mapping for {cls.__name__}, got {d!r}")
    return cls(**d)


# -- requirements -----------------------------------------------------------------------
class MissingCapability(UpstreamFault):
    """The lane needs what this machine or build lacks (a GPU backend, ...)."""


def check_requirements(cfg: BenchConfig) -> dict:
    """The build's backends and devices; raises RouteRefused if the policy refuses an MTP
    row (alpha: every one), MissingCapability if the lane needs a GPU and the build has
    none (``llama_supports_gpu_offload()`` alone is not enough: it is true on a CPU build
    with the RPC backend)."""
    from mtplib.runtime.devices import backend_info

    for k in cfg.ks:
        try:
            route(int(k), policy=cfg.policy)
        except RouteRefused as e:
            raise RouteRefused(f"bench: {e}; the bench compares MTP off with MTP on, so it "
                               "does not run under this policy") from None

    info = backend_info()
    if cfg.backend == "gpu" and not info["gpu_devices"]:
        raise MissingCapability(
            "this lane needs a GPU build of llama.cpp (e.g. CMAKE_ARGS='-DGGML_CUDA=ON "
            f"-DGGML_RPC=ON'); the installed build has only {info['backends']} devices "
            f"{[d['name'] for d in info['devices']]}, so the lane stops here")
    return info
