"""mtplib: DeepSeek-V4 MTP contract, runtime and evidence on upstream llama.cpp."""
