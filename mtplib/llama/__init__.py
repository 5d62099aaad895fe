"""MTP speculative decoding for llama-cpp-python users: `mtp_llama` returns a
`llama_cpp.Llama` whose ``draft_model`` is DeepSeek-V4's MTP block (`MTPDraftModel`).

Beside `distributed` in the layer picture: it may import `runtime` and below. With the
runtime, the one room that imports `llama_cpp` (its subject: `Llama`, `LlamaDraftModel`,
`_internals.LlamaContext`) and the runtime's raw bindings (`mtplib.runtime.lib.load`); it
never imports `ctypes` itself (tests/test_layers.py).
"""

# importing this package loads llama_cpp (draft.py subclasses its draft-model class):
# draft.py chooses the upstream build first (`mtplib.runtime.choose_upstream`)
from mtplib.llama.build import mtp_llama, plain_llama
from mtplib.llama.draft import DraftStats, MTPDraftModel

__all__ = ["DraftStats", "MTPDraftModel", "mtp_llama", "plain_llama"]
