"""The reports of evidence/graph-reuse/: bytes per step by kind and class, client drafting on
shared cores, WAN cells through the CLI, and prefill with pipeline parallelism."""
