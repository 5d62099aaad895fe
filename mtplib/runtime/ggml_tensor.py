"""ggml's tensor struct and the eval callback, for observing the graphs upstream builds.

llama-cpp-python does not bind `struct ggml_tensor`; the layout below is copied from
`ggml/include/ggml.h` at the pinned commit and checked at first use against
`ggml_get_name` (a wrong layout raises instead of reading garbage).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from mtplib.errors import InputError, UpstreamFault

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
GGML_TYPE_F32 = 0
BUFFER_USAGE_WEIGHTS = 1


class GGMLTensor(ctypes.Structure):
    pass


GGMLTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GGMLTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(GGMLTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]

_lib: dict = {}


def ggml() -> ctypes.CDLL:
    """libggml-base from the installed llama_cpp (same process, already loaded)."""
    if "base" not in _lib:
        from mtplib.runtime import choose_upstream

        choose_upstream()  # the selected build's libggml, never the stock one by accident
        import llama_cpp

        base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        base.ggml_get_name.argtypes = [ctypes.c_void_p]
        base.ggml_get_name.restype = ctypes.c_char_p
        base.ggml_nbytes.argtypes = [ctypes.c_void_p]
        base.ggml_nbytes.restype = ctypes.c_size_t
        base.ggml_op_name.argtypes = [ctypes.c_int]
        base.ggml_op_name.restype = ctypes.c_char_p
        base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_size_t, ctypes.c_size_t]
        base.ggml_backend_tensor_get.restype = None
        base.ggml_backend_buffer_get_usage.argtypes = [ctypes.c_void_p]
        base.ggml_backend_buffer_get_usage.restype = ctypes.c_int
        base.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
        base.ggml_is_contiguous.restype = ctypes.c_bool
        _lib["base"] = base
        _lib["checked"] = False
    return _lib["base"]


def as_tensor(ptr: int | ctypes.c_void_p) -> GGMLTensor:
    """View a `ggml_tensor *` as the struct, checking the layout once."""
    t = ctypes.cast(ptr, ctypes.POINTER(GGMLTensor)).contents
    if not _lib.get("checked"):
        lib = ggml()
        if lib.ggml_get_name(ctypes.addressof(t)) != t.name:
            raise UpstreamFault("ggml_tensor layout mismatch: the pinned ggml.h changed")
        _lib["checked"] = True
    return t


def name(t: GGMLTensor) -> str:
    return t.name.decode("utf-8", "replace")


def op_name(t: GGMLTensor) -> str:
    return ggml().ggml_op_name(t.op).decode()


def sources(t: GGMLTensor) -> Iterator[GGMLTensor]:
    for i in range(GGML_MAX_SRC):
        s = t.src[i]
        if s:
            yield s.contents


def is_weight(t: GGMLTensor) -> bool:
    """A tensor whose (view source's) buffer holds model weights."""
    while t.view_src:
        t = t.view_src.contents
    return bool(t.buffer) and ggml().ggml_backend_buffer_get_usage(t.buffer) == BUFFER_USAGE_WEIGHTS


def read_f32(t: GGMLTensor) -> np.ndarray:
    """Copy a contiguous F32 tensor's data (any backend) to a numpy array, shape reversed."""
    if t.type != GGML_TYPE_F32:
        raise TypeError(f"{name(t)} is not F32 (type {t.type})")
    lib = ggml()
    addr = ctypes.addressof(t)
    if not lib.ggml_is_contiguous(addr):
        raise InputError(f"{name(t)} is not contiguous")
    n = lib.ggml_nbytes(addr)
    out = np.empty(n // 4, dtype=np.float32)
    lib.ggml_backend_tensor_get(addr, out.ctypes.data, 0, n)
    shape = [int(x) for x in t.ne][::-1]
    return out.reshape(shape)


EvalFn = Callable[[GGMLTensor, bool], bool]


def eval_callback(fn: EvalFn) -> Callable[[int, bool, int], bool]:
    """Adapt ``fn(tensor, ask) -> bool`` to the raw cb_eval signature (t, ask, user_data).

    Upstream calls it with ask=True per node ("do you want to see this one?") and, for
    those answered True, again with ask=False once the node is computed.
    """

    def raw(ptr: int, ask: bool, _user: int) -> bool:
        try:
            return bool(fn(as_tensor(ptr), bool(ask)))
        except Exception:  # noqa: BLE001 - an exception must not cross into C
            import traceback

            traceback.print_exc()
            return False

    return raw
