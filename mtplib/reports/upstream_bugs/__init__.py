"""The repros and probes of evidence/upstream-bugs/: each drives upstream the way its bug
report says and prints what it finds."""
