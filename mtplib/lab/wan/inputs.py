"""What a WAN run is given besides its config (`mtplib.lab.wan`): each shard's emulated link
(`links_for`, `wan_arg`), the held-out prompts of the trained pair (`trained_prompts`) and
the context the CLI would use (`default_ctx`), so warm and cold runs start alike.
"""

from __future__ import annotations

from mtplib.lab.wan.config import WanConfig


def links_for(topology: str, n_shards: int, rtt_ms: float, mbit: float | None = None) -> list:
    """Each shard's link: ``rtt_ms`` and the ``mbit`` cap, except a co-located tail's."""
    from mtplib.runtime.links import WanLink

    if topology == "remote":
        return [WanLink(rtt_ms, mbit)] * n_shards
    return [WanLink(rtt_ms, mbit)] * (n_shards - 1) + [WanLink()]


def wan_arg(topology: str, n_shards: int, rtt_ms: float, mbit: float | None = None) -> str:
    """The ``--wan`` value of `mtplib generate` for a topology (``RTT[:MBIT]`` per shard)."""
    return ",".join(str(w) for w in links_for(topology, n_shards, rtt_ms, mbit))


def trained_prompts(n: int, length: int) -> list[list[int]]:
    """``n`` held-out prompts of the committed trained pair (the stdlib modules it never
    saw in training), as `mtplib.lab.trained_eval` measures acceptance on."""
    from mtplib.lab.trained_eval import heldout_modules, heldout_tokens, prompts_from
    from mtplib.model.trained import trained_paths

    pair = trained_paths()
    docs = heldout_tokens(pair.trunk, heldout_modules())
    return prompts_from(docs, n=n, length=length, seed=0)


def decode_settings(cfg: WanConfig, trunk: str):
    from mtplib.runtime.settings import DecodeSettings

    return DecodeSettings(n_ctx=cfg.n_ctx or default_ctx(trunk), n_threads=cfg.threads)


def default_ctx(trunk: str) -> int:
    """The context size `mtplib generate` uses without --ctx, so both modes run alike: the
    same rule (`mtplib.runtime.request.default_n_ctx`), not a copy of it."""
    from mtplib.runtime.request import default_n_ctx

    return default_n_ctx(trunk)
