"""The pinned upstream, in one place.

Everything that must match the upstream build (package version, llama.cpp commit, the
build flags we rely on) lives here so that set-up scripts, start-up checks and run
records read the same values.
"""

from __future__ import annotations

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
LLAMA_CPP_COMMIT_SHORT = LLAMA_CPP_COMMIT[:9]
CMAKE_ARGS = "-DGGML_RPC=ON"
#: Shared libraries that must sit in ``llama_cpp/lib`` of a correct build.
REQUIRED_LIBS = ("libllama.so", "libggml-rpc.so")
#: MTP staging symbols reached through ``llama_cpp.llama_cpp_ext``.
REQUIRED_EXT_SYMBOLS = (
    "llama_set_embeddings_nextn",
    "llama_get_embeddings_nextn",
    "llama_get_embeddings_nextn_ith",
    "llama_set_nextn_layer_offset",
)
FIX_HINT = (
    f"run `./dev.sh setup` (it builds llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} from "
    f"source with CMAKE_ARGS='{CMAKE_ARGS}' into .venv)"
)


def as_dict() -> dict[str, str]:
    """The pins as recorded in run records and evidence."""
    return {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "cmake_args": CMAKE_ARGS,
    }
