"""The report of evidence/dspark-shards/: DSpark drafting on shards with the drafter in the
client, bytes, waits and feature bytes per step kind."""
