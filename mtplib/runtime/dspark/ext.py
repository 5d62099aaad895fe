"""The four C++-linkage calls DSpark drafting needs that llama-cpp-python 0.3.36 lacks.

Why by mangled name: upstream declares them in src/llama-ext.h without ``extern "C"``, so
libllama exports them under their Itanium C++ names (checked with ``nm -D`` on the pinned
build) and the Python bindings (llama_cpp_ext.py) bind none of them. They are resolved
once from the libllama the runtime loaded (`mtplib.runtime.lib.load`); a build without
them gives one clear UpstreamError, never an AttributeError mid-run.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from mtplib.runtime.lib import UpstreamError, load

#: name -> (exported symbol, argtypes, restype), from src/llama-ext.h:111-128 at the pin
SYMBOLS: dict[str, tuple[str, list, object]] = {
    "llama_set_embeddings_layer_inp": (
        "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
        [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": (
        "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
        [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "llama_model_target_layer_ids": (
        "_Z28llama_model_target_layer_idsPK11llama_model",
        [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)),
    "llama_model_target_layer_ids_n": (
        "_Z30llama_model_target_layer_ids_nPK11llama_model",
        [ctypes.c_void_p], ctypes.c_uint32),
}


@dataclass(frozen=True)
class DSparkExt:
    """The resolved C functions (each takes the raw context / model pointer)."""

    set_layer_inp: object
    get_layer_inp: object
    target_layer_ids: object
    target_layer_ids_n: object

    def layer_ids(self, model_ptr: int) -> tuple[int, ...]:
        """A draft model's target layer ids, as upstream read them from the file."""
        n = int(self.target_layer_ids_n(model_ptr))
        p = self.target_layer_ids(model_ptr)
        if n and not p:
            raise UpstreamError("llama_model_target_layer_ids returned NULL")
        return tuple(int(p[i]) for i in range(n))


_lock = threading.Lock()
_cache: dict[str, DSparkExt] = {}


def dspark_ext() -> DSparkExt:
    """The four calls from the loaded libllama (resolved once per process)."""
    with _lock:
        if "ext" not in _cache:
            llama, _ = load()
            lib = getattr(llama, "_lib", None)
            if lib is None:
                raise UpstreamError("llama_cpp exposes no loaded libllama (_lib): DSpark "
                                    "drafting cannot bind its layer-input calls")
            funcs = []
            for name, (sym, argtypes, restype) in SYMBOLS.items():
                try:
                    f = getattr(lib, sym)
                except AttributeError:
                    raise UpstreamError(
                        f"this libllama lacks {name} (symbol {sym}): DSpark drafting needs "
                        "the pinned llama.cpp 0c1e57098 (src/llama-ext.h)") from None
                f.argtypes, f.restype = argtypes, restype
                funcs.append(f)
            _cache["ext"] = DSparkExt(*funcs)
        return _cache["ext"]
