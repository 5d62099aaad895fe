"""A DSpark draft file (GGUF arch ``dflash`` with ``markov_w1``), pure: its configuration,
tensors and keys (`spec`), a deterministic random-weight writer (`fixture`) and the checks
that refuse a malformed one before upstream sees it (`validate`)."""
