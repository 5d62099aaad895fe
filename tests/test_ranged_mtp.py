"""DGR-066 part 2: whole vs ranged (RPC shards on loopback), MTP off and on."""

import pytest

from mtplib.distributed.ranged_mtp import RangedMTP
from mtplib.lab.correctness import seeded_prompt
from mtplib.runtime.speculative import EngineOptions, MTPRuntime

PROMPT = seeded_prompt(7, 10)
N_NEW = 16


@pytest.fixture(scope="module")
def whole(pair):
    out = {}
    for k in (0, 1, 2, 3):
        with MTPRuntime(str(pair.trunk), str(pair.sidecar) if k else None, k=k) as rt:
            out[k] = rt.generate(PROMPT, N_NEW)
    return out


@pytest.mark.parametrize("plan", ["0-1,2-3", "0-0,1-2,3-3"])
def test_ranged_equals_whole_mtp_off_and_on(pair, whole, plan):
    # the MTP block on the tail shard, explicitly (the default is the client)
    with RangedMTP(str(pair.trunk), plan=plan, sidecar=str(pair.sidecar),
                   mtp_placement="tail") as r:
        tail = r.rt.endpoints[-1]
        for k in (0, 1, 2, 3):
            toks, m = r.generate(PROMPT, N_NEW, EngineOptions(k=k))
            assert toks == whole[k][0], (plan, k)
            assert toks == whole[0][0]
            if k:
                assert m["drafted"] == whole[k][1]["drafted"]
                assert m["mtp_placement"] == "tail" and m["mtp_endpoints"] == [tail]  # on the tail
                assert {"prefill", "verify", "draft"} <= set(m["seam_bytes_per_token"])
                # MTP runs on the tail: drafting moves far less than a verify step
                assert m["seam_bytes_per_token"]["draft"] < m["seam_bytes_per_token"]["verify"]
            else:
                assert "draft" not in m["seam_bytes_per_token"]
            assert m["seam_bytes"] > 0 and m["plan"] == plan
        owners = sorted(set(m["placement"].values()), key=r.rt.endpoints.index)
        assert owners == r.rt.endpoints  # every shard owns some of the trunk's layers
