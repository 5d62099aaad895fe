"""The report of evidence/placement/: which drafter placement wins where, from measured
inputs."""
