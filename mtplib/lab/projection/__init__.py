"""Projection: ranged DeepSeek-V4-Flash MTP over a WAN, from its tensor table and a message
structure (issue 14 item 7).

Why: the WAN benchmark runs on a tiny trained pair; whether ranged MTP pays for the real
model depends on V4-Flash's sizes (hidden rows, vocabulary, masks, the indexer's rotation
matrix) and on how many times per step the client waits on a shard. This package puts the
two together with the cost model of the issue,

    t_step = compute + RTT x waits_on_remote_shards + bytes_on_remote_links / bandwidth,

and answers which shard plans fit one H200 each. Pure Python: it reads the weight-less
V4-Flash table (`mtplib fixture --preset v4-flash`) through `mtplib.ownership` and never
loads llama.cpp. Nothing here measures V4-Flash; every default names its source in
`DEFAULT_SOURCES` and evidence/wan/PROJECTION.md, and the measured inputs (the message
structures, the graph and control bytes per shard pass) name the runs they come from.

Topology (upstream's RPC backend, reference §8): a star. A boundary value goes shard i ->
client (GET_TENSOR: the client waits) -> shard i+1 (SET_TENSOR: fire-and-forget); graph
inputs are set from the client into every shard whose split reads them, once per step.

Acceptance convention (as `mtplib.lab.bench`): ``acceptance[i]`` is the unconditional
probability that draft position i+1 is accepted (it counts only when every earlier one
is), so the expected tokens per verify step are ``1 + sum(acceptance[:k])``.

The model lives by concern, one module each (import a name from the module that defines
it): the sourced constants in `constants`, the message structure in `structure`, the scenario
and parameters in `params`, the compute inputs read from a layer-cost file in
`compute_inputs`, what a shard receives per step in `graph_inputs`, one step's traffic in
`traffic`, the compute model in `compute`, the tables in `sweep`, the H200 fit in `fit` and
the plot in `plots`.
"""
