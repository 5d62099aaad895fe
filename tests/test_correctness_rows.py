"""Issue 23 item 7: `correctness.whole_vs_ranged` says where each MTP row's block ran. It
compared the placement string with a list, so every ranged MTP row read
``mtp_on_tail: False`` whether or not the MTP block sat on the tail shard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mtplib.lab import correctness as C


def test_mtp_where_reads_the_placement_string_and_the_endpoints():
    tail = "127.0.0.1:5001"
    on_tail = SimpleNamespace(mtp_placement="tail", mtp_endpoints=[tail])  # RangedMetrics
    assert C._mtp_where(on_tail, tail, 2) == {"mtp_placement": "tail", "mtp_on_tail": True}
    client = SimpleNamespace(mtp_placement="client", mtp_endpoints=[])
    assert C._mtp_where(client, tail, 2) == {"mtp_placement": "client", "mtp_on_tail": False}
    spread = SimpleNamespace(mtp_placement="tail", mtp_endpoints=["127.0.0.1:5000", tail])
    assert C._mtp_where(spread, tail, 1)["mtp_on_tail"] is False
    assert C._mtp_where(on_tail, tail, 0) == {"mtp_placement": None, "mtp_on_tail": None}


@pytest.mark.parametrize(("placement", "on_tail"), [("tail", True), ("auto", False)])
def test_whole_vs_ranged_rows_say_where_mtp_ran(pair, placement, on_tail):
    rows = C.whole_vs_ranged(str(pair.trunk), str(pair.sidecar), plans=["0-1,2-3"], ks=[0, 1],
                             n_new=6, n_threads=1, mtp_placement=placement)
    off, mtp = rows
    assert (off["k"], off["mtp_on_tail"], off["mtp_placement"]) == (0, None, None)
    assert mtp["k"] == 1 and mtp["equal"]
    assert mtp["mtp_on_tail"] is on_tail
    assert mtp["mtp_placement"] == ("tail" if on_tail else "client")  # auto: the client
