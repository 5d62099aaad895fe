import types

import pytest

from mtplib import pins
from mtplib.runtime.lib import UpstreamError, check_pins, load


def test_loaded_build_matches_pins():
    load()
    import llama_cpp

    info = check_pins(llama_cpp)
    assert info["version"] == pins.LLAMA_CPP_PYTHON_VERSION


def test_wrong_build_gives_one_clear_error(tmp_path):
    fake = types.ModuleType("llama_cpp")
    fake.__version__ = "0.3.1"
    fake.__file__ = str(tmp_path / "llama_cpp" / "__init__.py")
    with pytest.raises(UpstreamError) as e:
        check_pins(fake)
    msg = str(e.value)
    assert "0.3.1, pinned 0.3.36" in msg and "libggml-rpc.so" in msg
    assert "./dev.sh setup" in msg
