"""The reports of evidence/upstream-patches/: what patches/0001-0007 change on the wire (waits,
bytes, tokens/s, star against ring) and the tables and projections built on those counts."""
