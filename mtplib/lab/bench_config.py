"""The benchmark's configuration: a lane's ``bench:`` section (`BenchConfig`), checked before
anything runs, and what it requires of the build (`check_requirements`). The runs are
`mtplib.lab.bench`'s; a bad section fails here with one line naming the key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtplib.contract.capabilities import RouteRefused
from mtplib.contract.labels import SEAM_CHOICES
from mtplib.contract.types import DRAFT_BOUNDS, DRAFT_RANGE
from mtplib.errors import InputError, UpstreamFault
from mtplib.lab.sweep import SweepConfig
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
    #: (`SEAM_CHOICES`: star, ring = patches/0007's shard to shard, auto); each ranged row
    #: says which ran, per shard pair (``seam``)
    seam: str = "star"

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
        errs = []
        if not self.ks or any(int(k) not in DRAFT_RANGE for k in self.ks):
            errs.append(f"ks must be draft lengths in {DRAFT_BOUNDS}, got {self.ks}")
        if not self.plans:
            errs.append("plans must list at least one plan ('whole' or ranges like '0-1,2-3')")
        if not self.prompts:
            errs.append("prompts must list at least one prompt")
        for p in self.prompts:
            if not isinstance(p, str) and not (isinstance(p, dict) and "seed" in p):
                errs.append(f"a prompt is a text or {{seed: N, len: L}}, got {p!r}")
        if self.n_new < 2:
            errs.append(f"n_new must be >= 2, got {self.n_new}")
        if self.reps < 1 or self.warmup < 0:
            errs.append("reps must be >= 1 and warmup >= 0")
        if int(self.threads or 0) < 1:
            errs.append("threads must be >= 1")
        if self.backend not in ("cpu", "gpu"):
            errs.append(f"backend must be cpu or gpu, got {self.backend!r}")
        if self.sweep is not None:
            s = self.sweep
            if not s.rates or any(not 0.0 <= float(r) <= 1.0 for r in s.rates):
                errs.append(f"sweep.rates must be in [0, 1], got {s.rates}")
            if not s.ks or any(int(k) not in DRAFT_RANGE for k in s.ks):
                errs.append(f"sweep.ks must be in {DRAFT_BOUNDS}, got {s.ks}")
            if s.reps < 1 or s.warmup < 0:
                errs.append("sweep.reps must be >= 1 and sweep.warmup >= 0")
            if s.draft_cost not in ("mtp", "none"):
                errs.append(f"sweep.draft_cost must be mtp or none, got {s.draft_cost!r}")
        if self.seam not in SEAM_CHOICES:
            errs.append(f"seam must be one of {', '.join(SEAM_CHOICES)}, got {self.seam!r}")
        if self.tls is not None and (not isinstance(self.tls, str) or not self.tls):
            errs.append(f"tls must be a directory (mtplib tls init DIR), got {self.tls!r}")
        if errs:
            raise BenchConfigError("bench: " + "; ".join(errs))
        self.tls_config()  # a missing file stops the bench before anything runs

    def tls_config(self):
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
