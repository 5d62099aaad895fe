"""The reports of evidence/ttft/: time to first token with allocation-size queries answered
by the relays or sent to the shards, and how many queries a load asks."""
