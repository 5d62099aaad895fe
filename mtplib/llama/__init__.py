"""MTP speculative decoding for llama-cpp-python users: `mtp_llama` returns a
`llama_cpp.Llama` whose ``draft_model`` is DeepSeek-V4's MTP block (`MTPDraftModel`).

Beside `distributed` in the layer picture: it may import `runtime` and below.
"""

from mtplib.llama.build import mtp_llama, plain_llama
from mtplib.llama.draft import DraftStats, MTPDraftModel

__all__ = ["DraftStats", "MTPDraftModel", "mtp_llama", "plain_llama"]
