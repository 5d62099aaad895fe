"""Ranged MTP over an emulated WAN: tokens/s against round-trip time, and why (the module
docstring of `measure` tells the modes and the cost model). One module per concern; import
a name from the module that defines it. ``python -m mtplib.lab.wan`` runs it (`__main__`)."""
