"""mtplib.contract.wire on its own: the classes of a step's tensor traffic and what each
seam tensor is (the names a counting relay saw on plan 0-1,2-3 of the trained pair)."""

from mtplib.contract.seam import FORBIDDEN_KINDS, SEAM_VALUES
from mtplib.contract.wire import (
    OTHER,
    SEAM_TENSORS,
    cache_tensors_on_wire,
    classify,
    classify_by_direction,
    classify_step,
    seam_by_value,
    seam_value,
    wire_violations,
)

# one plain decode on the stock build (bytes per decode of the trained pair, E=128, hc=4)
STOCK = [
    {("down", "l_last-1"): 2048, ("down", "node_343"): 2048,
     ("up", "RPC0[127.0.0.1:1]#attn_inp_k_rot#1"): 65536,
     ("up", "RPC0[127.0.0.1:1]#inp_tokens#1"): 4},
    {("down", "h_nextn"): 2048, ("up", "RPC0[127.0.0.1:2]#l_last-1#1"): 2048,
     ("up", "RPC0[127.0.0.1:2]#node_343#1"): 2048,
     ("up", "RPC0[127.0.0.1:2]#dsv4_hca_state_kv_l2 (view)#1"): 512},
]


def test_classes_of_a_stock_decode():
    c = classify_step(STOCK)
    assert c == {"seam": 8192, "outputs": 2048, "inputs": 4, "constants": 65536,
                 "cache": 512, "weights": 0}
    assert wire_violations({"decode": c}) and not wire_violations({"load": c})


def test_classes_by_link_and_direction_add_up_to_the_step_classes():
    """Per connection, which class went which way: a boundary value read out of shard 0
    (down) is the seam value written into shard 1 (up); the totals are classify_step's."""
    links = classify_by_direction(STOCK)
    assert links[0] == {"constants": {"up": 65536}, "inputs": {"up": 4},
                        "seam": {"down": 4096}}
    assert links[1] == {"cache": {"up": 512}, "outputs": {"down": 2048},
                        "seam": {"up": 4096}}
    total = {c: 0 for c in classify_step(STOCK)}
    for link in links:
        for c, ways in link.items():
            total[c] += sum(ways.values())
    assert total == classify_step(STOCK)
    assert classify_by_direction([{("peer", "l_last-1"): 100}]) == [{"seam": {"peer": 100}}]


def test_seam_tensors_are_the_boundary_value_and_a_derived_norm():
    assert seam_value("RPC0[127.0.0.1:2]#l_last-1#1") == "boundary_hidden"
    assert seam_value("l_last-41") == "boundary_hidden"
    assert seam_value("node_343") == OTHER  # stock's rms_norm(reshape(l_last)): unnamed
    assert seam_by_value(STOCK) == {"boundary_hidden": 4096, "mtp_hidden": 0, OTHER: 4096}
    # every named value is one of the contract's; the norm of one is forbidden by it
    assert set(SEAM_TENSORS.values()) <= set(SEAM_VALUES)
    assert "boundary_norm" in FORBIDDEN_KINDS and OTHER not in SEAM_VALUES


def test_patched_decode_moves_one_value_per_seam_and_no_constant():
    patched = [
        {("down", "l_last-1"): 2048, ("up", "RPC0[127.0.0.1:1]#inp_tokens#1"): 4},
        {("down", "h_nextn"): 2048, ("up", "RPC0[127.0.0.1:2]#l_last-1#1"): 2048},
    ]
    c = classify_step(patched)
    assert (c["seam"], c["constants"]) == (4096, 0)
    assert seam_by_value(patched)[OTHER] == 0
    # the once-per-context copy is a constant too (patches/0003), wherever it is counted
    assert classify_step([{("up", "attn_k_rot"): 65536}])["constants"] == 65536


def test_a_peer_push_is_a_boundary_value_unless_it_is_a_cache():
    """patches/0007's peer links (direction "peer"): seam bytes; a cache tensor stays
    forbidden there too."""
    assert classify("peer", "RPC1[127.0.0.1:2]#l_last-1#0", set()) == "seam"
    assert classify("peer", "cache_k_l2", set()) == "cache"
    per_relay = [{("peer", "l_last-1"): 100, ("peer", "cache_k_l2 (view)"): 8}]
    assert classify_step(per_relay)["seam"] == 100
    assert cache_tensors_on_wire(per_relay) == {"cache_k_l2": 8}
