"""Drive ggml's RPC client directly (ctypes) to exercise patches/0002's GET queue.

Run as a script on one build (MTPLIB_UPSTREAM=stock|patched); prints one JSON line. Two
shard processes (`mtplib shard serve`) A and B, each behind a counting relay with a short
emulated link (so that pipelined requests are one wait: mtplib.distributed.relay), and:

- ``many``: N_MANY async GETs of tensors on A, then one synchronize (more than the 64 the
  client pipelines at once on TCP; an application's own reads, e.g. llama.cpp's outputs)
- ``two``: two backends on A's endpoint (one client connection: ggml-rpc keeps one
  dispatcher per endpoint), each read N_TWO times from its own thread, concurrently
- ``split``: a scheduled graph over [A, B, CPU] whose split on B reads N_SPLIT inputs from A
  (neither side in host memory: 0002's staged path) and one from the CPU (host: the
  direct path), run twice on the same allocation (the staging buffers are reused)
- ``no_sync``: async GETs, then the backend and the buffer freed with no synchronize (the
  buffer's free is the command that sends the queued GETs; data must arrive, no hang)
"""

from __future__ import annotations

import ctypes
import json
import threading
from pathlib import Path

import numpy as np

from mtplib.distributed.processes import LocalShards
from mtplib.distributed.relay import CountingRelay, WanLink
from mtplib.runtime import build_info
from mtplib.runtime.lib import load

N_MANY, N_TWO, N_SPLIT, NE = 100, 40, 24, 64
F32 = 0
vp, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", sz), ("mem_buffer", vp), ("no_alloc", ctypes.c_bool)]


def _libs() -> tuple:
    load()
    import llama_cpp

    d = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(d / "libggml-base.so"))
    cpu = ctypes.CDLL(str(d / "libggml-cpu.so"))
    rpc = ctypes.CDLL(str(d / "libggml-rpc.so"))
    for lib, fn, args, res in (
        (base, "ggml_init", [InitParams], vp),
        (base, "ggml_free", [vp], None),
        (base, "ggml_tensor_overhead", [], sz),
        (base, "ggml_graph_overhead", [], sz),
        (base, "ggml_new_tensor_1d", [vp, ctypes.c_int, i64], vp),
        (base, "ggml_add", [vp, vp, vp], vp),
        (base, "ggml_new_graph", [vp], vp),
        (base, "ggml_build_forward_expand", [vp, vp], None),
        (base, "ggml_backend_alloc_ctx_tensors", [vp, vp], vp),
        (base, "ggml_backend_buffer_free", [vp], None),
        (base, "ggml_backend_tensor_set", [vp, vp, sz, sz], None),
        (base, "ggml_backend_tensor_get", [vp, vp, sz, sz], None),
        (base, "ggml_backend_tensor_get_async", [vp, vp, vp, sz, sz], None),
        (base, "ggml_backend_synchronize", [vp], None),
        (base, "ggml_backend_free", [vp], None),
        (base, "ggml_backend_sched_new", [vp, vp, ctypes.c_int, sz, ctypes.c_bool,
                                          ctypes.c_bool], vp),
        (base, "ggml_backend_sched_set_tensor_backend", [vp, vp, vp], None),
        (base, "ggml_backend_sched_alloc_graph", [vp, vp], ctypes.c_bool),
        (base, "ggml_backend_sched_graph_compute", [vp, vp], ctypes.c_int),
        (base, "ggml_backend_sched_free", [vp], None),
        (cpu, "ggml_backend_cpu_init", [], vp),
        (rpc, "ggml_backend_rpc_init", [ctypes.c_char_p, ctypes.c_uint32], vp),
    ):
        f = getattr(lib, fn)
        f.argtypes, f.restype = args, res
    return base, cpu, rpc


BASE, CPU, RPC = _libs()


def _ctx(n_tensors: int, *, no_alloc: bool = True, graph: bool = False):
    size = n_tensors * BASE.ggml_tensor_overhead() + (BASE.ggml_graph_overhead() if graph else 0)
    return BASE.ggml_init(InitParams(size, None, no_alloc))


def _on(backend, values: list[np.ndarray]):
    """Tensors holding ``values`` in a buffer of ``backend``: (ctx, buffer, tensors)."""
    ctx = _ctx(len(values))
    ts = [BASE.ggml_new_tensor_1d(ctx, F32, NE) for _ in values]
    buf = BASE.ggml_backend_alloc_ctx_tensors(ctx, backend)
    assert buf, "allocation failed"
    for t, v in zip(ts, values, strict=True):
        BASE.ggml_backend_tensor_set(t, v.ctypes.data, 0, v.nbytes)
    return ctx, buf, ts


def _values(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(NE).astype(np.float32) for _ in range(n)]


def _read_async(backend, ts, n: int) -> list[np.ndarray]:
    out = [np.zeros(NE, np.float32) for _ in range(n)]
    for t, o in zip(ts, out, strict=True):
        BASE.ggml_backend_tensor_get_async(backend, t, o.ctypes.data, 0, o.nbytes)
    BASE.ggml_backend_synchronize(backend)
    return out


def _waits(relay: CountingRelay, label: str) -> int:
    return relay.snapshot().get(label, {}).get("waits", 0)


def main() -> None:
    res: dict = {"build": build_info()["build"]}
    with LocalShards(2, threads=1) as shards:
        relays = [CountingRelay(ep, link=WanLink(10)) for ep in shards.endpoints]
        a, b = (RPC.ggml_backend_rpc_init(r.endpoint.encode(), 0) for r in relays)
        assert a and b

        vals = _values(N_MANY, 1)
        ctx, buf, ts = _on(a, vals)
        relays[0].label = "many"
        got = _read_async(a, ts, N_MANY)
        relays[0].label = "other"
        res["many"] = {"equal": all(np.array_equal(g, v) for g, v in zip(got, vals, strict=True)),
                       "waits": _waits(relays[0], "many")}

        # two backends (two "contexts") on A's endpoint, read from two threads at once
        a2 = RPC.ggml_backend_rpc_init(relays[0].endpoint.encode(), 0)
        seen: list[bool] = []

        def reader(backend, lo: int) -> None:
            for _ in range(5):
                got = _read_async(backend, ts[lo:lo + N_TWO], N_TWO)
                seen.append(all(np.array_equal(g, v) for g, v
                                in zip(got, vals[lo:lo + N_TWO], strict=True)))

        th = [threading.Thread(target=reader, args=(bk, lo)) for bk, lo in ((a, 0), (a2, 50))]
        for t in th:
            t.start()
        for t in th:
            t.join(120)
        res["two"] = {"equal": len(seen) == 10 and all(seen),
                      "hung": any(t.is_alive() for t in th)}
        BASE.ggml_backend_free(a2)

        # a scheduled split on B with N_SPLIT inputs from A and one from the CPU
        cpu = CPU.ggml_backend_cpu_init()
        xv, yv, cv = _values(N_SPLIT, 2), _values(N_SPLIT, 3), _values(1, 4)
        cx, bx, xs = _on(a, xv)
        cy, by, ys = _on(b, yv)
        cc, bc, cs = _on(cpu, cv)
        g = _ctx(2 * N_SPLIT + 8, graph=True)
        inner = [BASE.ggml_add(g, x, y) for x, y in zip(xs, ys, strict=True)]
        zs = [BASE.ggml_add(g, s, cs[0]) for s in inner]
        gf = BASE.ggml_new_graph(g)
        for z in zs:
            BASE.ggml_build_forward_expand(gf, z)
        backends = (vp * 3)(a, b, cpu)
        sched = BASE.ggml_backend_sched_new(backends, None, 3, 2048, False, False)
        runs = []
        for r in range(2):
            if r == 0:  # the adds run on B: the x's are A -> B split inputs
                for z in inner + zs:
                    BASE.ggml_backend_sched_set_tensor_backend(sched, z, b)
                assert BASE.ggml_backend_sched_alloc_graph(sched, gf)
            # (run 1 reuses the allocated graph, as llama.cpp's graph reuse does)
            for i, x in enumerate(xs):  # new values each run: the copies are fresh
                v = xv[i] + r
                BASE.ggml_backend_tensor_set(x, v.ctypes.data, 0, v.nbytes)
            relays[0].label = f"split{r}"
            assert BASE.ggml_backend_sched_graph_compute(sched, gf) == 0
            relays[0].label = "other"
            out = [np.zeros(NE, np.float32) for _ in zs]
            for z, o in zip(zs, out, strict=True):
                BASE.ggml_backend_tensor_get(z, o.ctypes.data, 0, o.nbytes)
            want = [xv[i] + r + yv[i] + cv[0] for i in range(N_SPLIT)]
            runs.append({"equal": all(np.allclose(o, w, rtol=0, atol=1e-5)
                                      for o, w in zip(out, want, strict=True)),
                         "waits": _waits(relays[0], f"split{r}")})
        res["split"] = runs
        BASE.ggml_backend_sched_free(sched)
        BASE.ggml_free(g)
        for bf, cx_ in ((bx, cx), (by, cy), (bc, cc)):
            BASE.ggml_backend_buffer_free(bf)
            BASE.ggml_free(cx_)

        # queued GETs, then everything freed with no synchronize
        out = [np.zeros(NE, np.float32) for _ in range(3)]
        for t, o in zip(ts[:3], out, strict=True):
            BASE.ggml_backend_tensor_get_async(a, t, o.ctypes.data, 0, o.nbytes)
        BASE.ggml_backend_free(a)
        BASE.ggml_backend_buffer_free(buf)
        res["no_sync"] = {"equal": all(np.array_equal(o, v) for o, v
                                       in zip(out, vals[:3], strict=True))}
        BASE.ggml_free(ctx)
        BASE.ggml_backend_free(b)
        BASE.ggml_backend_free(cpu)
        for r in relays:
            r.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
