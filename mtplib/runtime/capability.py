"""What this runtime can honestly advertise per MTP recipe, fail-closed.

`unsupported`: no sidecar, wrong upstream pin, a pair that does not belong together, a
config upstream would crash on, or an MTP context upstream refused; a DSpark recipe without
a DSpark draft (a `dflash` sidecar checked against the trunk, `validate_dspark`) or past
its block size. `disabled`: the recipe
would run here but the policy (alpha) disables MTP. `implemented`: the recipe runs here.
`certified`: only with a recorded, passing certification run for the exact sha256 of the
trunk and the sidecar (see `certify`). Nothing is assumed.
"""

from __future__ import annotations

from pathlib import Path

from mtplib.contract.capabilities import Capability, Policy, build_advert
from mtplib.contract.types import MAX_DRAFT, MIN_DRAFT, MTP_OFF, RECIPES, DraftSpec
from mtplib.files import write_json
from mtplib.runtime.routing import (
    PIN,
    certified_recipes,
    model_key,
    resolve_policy,
)
from mtplib.stamps import now_iso

__all__ = ["PIN", "RECIPES", "Capability", "advertise", "certified_recipes", "certify",
           "model_key"]


def advertise(trunk: str | Path, sidecar: str | Path | None, *, shard_index: int = 0,
              cert_dir: str | Path = "certifications", probe: bool = True,
              policy: Policy | str | None = None) -> Capability:
    """Advertise every recipe for this trunk (+ sidecar) on this build; fail closed.

    Under a policy that disables MTP (alpha; default: $MTPLIB_POLICY, else beta) every MTP
    and DSpark recipe that would run is DISABLED, and no MTP context is probed. A DSpark
    sidecar is checked as the runtime checks it (header and pairing, no context probed).
    The advert is built by the contract's `build_advert`, as the adverts every run routes
    on are."""
    from mtplib.model.arch import config_from_keys
    from mtplib.model.dspark.validate import is_dspark, validate_dspark
    from mtplib.model.gguf_header import read_header
    from mtplib.runtime.lib import UpstreamError, load
    from mtplib.runtime.model import check_pair

    pol = resolve_policy(policy)
    try:
        load()
    except UpstreamError as e:
        return build_advert(shard_index, pin="unknown", policy=pol, has_mtp_sidecar=False,
                            build_problem=f"wrong upstream build: {e}")
    mtp_problem, dspark_problem, dspark_block, dspark = "", "", 0, False
    if sidecar is None:
        mtp_problem = "no MTP sidecar"
    else:
        try:
            th, sh = read_header(trunk), read_header(sidecar)
            dspark = is_dspark(sh)
            if dspark:
                mtp_problem = "no MTP sidecar (the draft is a DSpark draft)"
                dspark_block = min(validate_dspark(sh, th).block_size, MAX_DRAFT)
            else:
                check_pair(th, sh)
                config_from_keys(sh.kv, sh.n_vocab).validate()
                if probe and pol.allow_mtp:
                    _probe_mtp_context(str(sidecar))
        except Exception as e:  # noqa: BLE001 - any failure means unsupported, with why
            mtp_problem = f"{type(e).__name__}: {e}"
            dspark_problem = mtp_problem if dspark else ""
    return build_advert(shard_index, pin=PIN, policy=pol,
                        has_mtp_sidecar=sidecar is not None and not dspark,
                        mtp_problem=mtp_problem,
                        certified=certified_recipes(trunk, sidecar, cert_dir),
                        has_dspark_draft=dspark, dspark_block=dspark_block,
                        dspark_problem=dspark_problem)


def _probe_mtp_context(sidecar: str) -> None:
    """Create (and free) an MTP context: upstream may refuse it for this file."""
    from mtplib.runtime.model import Context, ContextConfig, Model

    with Model(sidecar, load_mtp=True) as m, \
            Context(m, ContextConfig(n_ctx=256, mtp=True, nextn_rows="masked")):
        pass


def certify(trunk: str, sidecar: str, *, cert_dir: str | Path = "certifications",
            prompts: list[list[int]] | None = None, n_new: int = 48, n_threads: int = 2
            ) -> dict:
    """Certification run: for every MTP recipe (draft1..MAX_DRAFT), MTP-on greedy output
    must equal MTP-off on every prompt. Writes ``cert_dir/<model_key>.json``; returns the record."""
    from mtplib.runtime.speculative import MTPRuntime

    prompts = prompts or [[1, 2, 3, 4, 5, 6, 7, 8], list(range(10, 60, 3)), [42] * 12]
    with MTPRuntime(trunk, None, k=0, n_threads=n_threads) as rt:
        ref = [rt.generate(p, n_new)[0] for p in prompts]
    rec = {"model_key": model_key(trunk, sidecar), "pin": PIN, "when": now_iso(),
           "n_new": n_new, "prompts": prompts, "recipes": {}}
    rec["recipes"][MTP_OFF] = {"passed": True, "note": "reference run"}
    for k in range(MIN_DRAFT, MAX_DRAFT + 1):
        with MTPRuntime(trunk, sidecar, k=k, n_threads=n_threads) as rt:
            outs = [rt.generate(p, n_new)[0] for p in prompts]
        equal = [o == r for o, r in zip(outs, ref, strict=True)]
        rec["recipes"][DraftSpec(k).recipe] = {"passed": all(equal), "equal": equal}
    out = Path(cert_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{rec['model_key']}.json", rec, indent=2, sort_keys=True)
    return rec
