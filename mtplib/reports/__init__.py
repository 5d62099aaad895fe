"""The reports that make the committed evidence: one subpackage per evidence folder
(``evidence/<topic>/`` keeps the data, its README and run record; the code that measured or
rendered it lives here), each report a module run as ``python -m mtplib.reports.<topic>.<name>``.

Reports sit on top with the commands: they may import every layer below, and nothing in
``mtplib`` imports them (tests/test_layers.py).
"""
