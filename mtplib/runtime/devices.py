"""What the loaded llama.cpp build can run on: its backends and devices (ggml registry).

`llama_supports_gpu_offload()` is true on a CPU-only build with the RPC backend (RPC
devices count as offload targets), so a GPU lane asks the device registry instead: a GPU
lane needs at least one local device of type GPU or IGPU (RPC devices excluded).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from mtplib.runtime.lib import load

#: enum ggml_backend_dev_type (ggml-backend.h)
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}

_ggml: dict = {}


def _lib() -> ctypes.CDLL:
    if "lib" not in _ggml:
        load()
        import llama_cpp

        g = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        for fn, args, res in (("ggml_backend_dev_count", [], sz),
                              ("ggml_backend_dev_get", [sz], vp),
                              ("ggml_backend_dev_type", [vp], ctypes.c_int),
                              ("ggml_backend_dev_name", [vp], cp),
                              ("ggml_backend_dev_description", [vp], cp),
                              ("ggml_backend_reg_count", [], sz),
                              ("ggml_backend_reg_get", [sz], vp),
                              ("ggml_backend_reg_name", [vp], cp),
                              ("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz),
                                                           ctypes.POINTER(sz)], None)):
            f = getattr(g, fn)
            f.argtypes, f.restype = args, res
        _ggml["lib"] = g
    return _ggml["lib"]


def devices() -> list[dict]:
    """Every device the build registered: name, description, type (cpu/gpu/igpu/accel)."""
    g = _lib()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        out.append({"name": g.ggml_backend_dev_name(d).decode(),
                    "description": g.ggml_backend_dev_description(d).decode(),
                    "type": DEVICE_TYPES.get(g.ggml_backend_dev_type(d), "unknown")})
    return out


def backends() -> list[str]:
    g = _lib()
    return [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode()
            for i in range(g.ggml_backend_reg_count())]


def gpu_devices() -> list[dict]:
    """Local GPU devices (RPC devices excluded): empty on a CPU-only build. Each also has
    ``memory_total`` (bytes, as the device reports it), so a lane can say whether a model
    fits; RPC devices are never asked (that would be a network call)."""
    g = _lib()
    out = []
    for i, d in enumerate(devices()):
        if d["type"] in ("gpu", "igpu") and not d["name"].upper().startswith("RPC"):
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            g.ggml_backend_dev_memory(g.ggml_backend_dev_get(i), ctypes.byref(free),
                                      ctypes.byref(total))
            out.append({**d, "memory_total": int(total.value)})
    return out


def backend_info() -> dict:
    """For run records and benchmark rows."""
    llama, _ = load()
    return {"backends": backends(), "devices": devices(),
            "gpu_offload_api": bool(llama.llama_supports_gpu_offload()),
            "gpu_devices": [d["name"] for d in gpu_devices()]}
