"""DSpark drafting (V4-Flash-0731's speculative module, GGUF arch ``dflash``): the draft's
model and contexts and the target's features (`context`), the drafter behind the
`Drafter` interface (`drafter`), the four C++ calls the bindings lack (`ext`), the graph
check of its ownership (`graph_reads`) and the draft in a ranged run (`ranged`)."""
