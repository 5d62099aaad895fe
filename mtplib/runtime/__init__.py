"""The only layer that touches llama.cpp (ctypes): models, contexts, decoding loops."""
