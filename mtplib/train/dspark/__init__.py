"""A trained tiny DSpark draft (V4 `dflash` + Markov and confidence heads) for the trained
trunk of evidence/trained-v4/ (optional extra ``train``: torch, tokenizers).

Modules: config (hyper-parameters, no torch), model (the draft as upstream's dflash.cpp
computes it), data (the trunk's greedy continuations), metrics (acceptance from
teacher-forced correctness), train (the loop), export (the `dflash` GGUF), parity (torch
vs upstream).
"""
