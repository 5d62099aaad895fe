"""The reports of evidence/wan/: the V4-Flash projection page and plot, waits by step kind
and placement, and the WAN target run's headline table."""
