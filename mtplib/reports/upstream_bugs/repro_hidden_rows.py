"""Reproduce: llama_get_embeddings_nextn returns wrong rows while the logits are right.

Standalone apart from the GGUF: it writes mtplib's tiny DeepSeek-V4 fixture (preset tiny,
seed 0) and then calls llama.cpp only through the llama_cpp bindings (llama-cpp-python
0.3.36, llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f).

    python -m mtplib.reports.upstream_bugs.repro_hidden_rows [--out DIR]

One decode of 7 tokens on a context with F32 K/V, flash attention off, n_ubatch 7 and
llama_set_embeddings_nextn(ctx, true, false). The rows returned by
llama_get_embeddings_nextn are compared with the `h_nextn` tensor read through cb_eval
when it is computed; both are pushed through the trunk's hc head + output_norm + output
in numpy and compared with the logits upstream returned. Then the same on a context where
the scheduler is made to reserve again after llama_set_embeddings_nextn (by clearing the
control vector, which sets sched_need_reserve).
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import numpy as np

from mtplib.reports import common

MODULE = "mtplib.reports.upstream_bugs.repro_hidden_rows"

N_TOKENS = 7
TOKENS = [11, 22, 33, 44, 55, 66, 77]


def ggml_base():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_size_t, ctypes.c_size_t]
    return lib


def head_logits(path: Path, rows: np.ndarray) -> np.ndarray:
    """Trunk tail in numpy: hc head -> output_norm -> output (all F32 in this fixture)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    t = {x.name: np.asarray(x.data, dtype=np.float64) for x in r.tensors
         if x.name.startswith("output")}

    def key(k):
        f = r.fields["deepseek4." + k]
        return float(f.parts[f.data[0]][0])

    eps, hc_eps = key("attention.layer_norm_rms_epsilon"), key("hyper_connection.epsilon")
    x = rows.astype(np.float64)
    n, E = x.shape[0], t["output_norm.weight"].shape[0]

    def rms(v):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps)

    mix = rms(x) @ t["output_hc_fn.weight"].T
    pre = 1 / (1 + np.exp(-(mix * t["output_hc_scale.weight"][0] + t["output_hc_base.weight"])))
    y = ((pre + hc_eps)[:, :, None] * x.reshape(n, -1, E)).sum(1)
    return (rms(y) * t["output_norm.weight"]) @ t["output.weight"].T


def run(path: Path, *, reserve_again: bool, reference: np.ndarray | None = None) -> dict:
    """One context, one decode. With ``reference`` (rows captured by an earlier run) no
    eval callback is installed and the API rows are compared with the reference."""
    from llama_cpp import llama_cpp as L
    from llama_cpp import llama_cpp_ext as X

    g = ggml_base()
    captured = []

    @L.ggml_backend_sched_eval_callback
    def cb(t, ask, _user):
        name = g.ggml_get_name(t)
        if ask:
            return name == b"h_nextn"
        buf = np.empty(g.ggml_nbytes(t) // 4, dtype=np.float32)
        g.ggml_backend_tensor_get(t, buf.ctypes.data, 0, buf.nbytes)
        captured.append(buf)
        return True

    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    width = L.llama_model_n_embd_out(model)  # hc * n_embd
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 7
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = 1
    if reference is None:
        cp.cb_eval = cb
    ctx = L.llama_init_from_model(model, cp)
    X.llama_set_embeddings_nextn(ctx, True, False)  # one row per batch token
    if reserve_again:  # no-op for a context without a control vector; sets sched_need_reserve
        assert L.llama_set_adapter_cvec(ctx, None, 0, L.llama_model_n_embd(model), -1, -1) == 0
    batch = L.llama_batch_init(N_TOKENS, 0, 1)
    for i, tok in enumerate(TOKENS):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, True
    batch.n_tokens = N_TOKENS
    assert L.llama_decode(ctx, batch) == 0
    api = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(ctx),
                                shape=(N_TOKENS * width,)).reshape(N_TOKENS, width).copy()
    logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                       for i in range(N_TOKENS)]).astype(np.float64)
    cap = np.concatenate(captured).reshape(N_TOKENS, width) if reference is None else reference
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    row_diff = np.abs(api - cap).max(axis=1)
    return cap, {
        "eval_callback": reference is None,
        "bad_rows": int((row_diff > 1e-5).sum()),
        "max_abs_diff_api_vs_callback": float(row_diff.max()),
        "logits_from_callback_rows_max_diff": float(np.abs(head_logits(path, cap) - logits).max()),
        "logits_from_api_rows_max_diff": float(np.abs(head_logits(path, api) - logits).max()),
        "max_abs_logit": float(np.abs(logits).max()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(MODULE, __doc__)
    ap.add_argument("--out", help="where to write the fixture (default: a temp dir)")
    a = ap.parse_args(argv)
    from llama_cpp import llama_cpp as L

    from mtplib.model.fixture import sha256_file, write_fixture

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="repro-hidden-"))
    trunk = write_fixture(out, seed=0, preset="tiny").trunk
    print(f"fixture {trunk} sha256 {sha256_file(trunk)}")
    quiet = L.llama_log_callback(lambda *_: None)  # keep a reference: upstream holds it
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    print("config: type_k=type_v=F32, flash_attn=disabled, n_ctx=512, n_batch=512, "
          "n_ubatch=7, embeddings_nextn=(true, masked=false), one decode of 7 tokens")
    cap, plain = run(trunk, reserve_again=False)
    print("as is:                     ", plain)
    _, nocb = run(trunk, reserve_again=False, reference=cap)
    print("as is, no eval callback:   ", nocb)
    _, fixed = run(trunk, reserve_again=True)
    print("with re-reserve:           ", fixed)
    bug = plain["bad_rows"] > 0 and nocb["bad_rows"] > 0 and fixed["bad_rows"] == 0
    print("REPRODUCED" if bug else "NOT REPRODUCED",
          f"- {plain['bad_rows']}/{N_TOKENS} rows wrong; after a re-reserve {fixed['bad_rows']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
