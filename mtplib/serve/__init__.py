"""`mtplib serve`'s HTTP service: an OpenAI- and llama-server-compatible API over one
loaded backend (docs/serve.md).

Split as llama.cpp's server (http, queue, task, context) and vLLM's entrypoints (protocol,
serving, api_router):

- what comes in: `config`, `protocol` (request models), `errors`, `fields` (every field
  known), `body` (reading it), `intake` (a body to a request, its sampler and job),
  `tokens` (prompt ids, context budget), `chat` (the chat prompt);
- the worker: `job`, `jobs` (the bounded queue), `worker`, `scheduler` (the interface, one
  slot), `batch` and `slots` (``--parallel N``), `generation` (one request), `stops`,
  `events` (what comes back, typed), `stats` (the slot table), `faults` (shard health);
- the request logic without HTTP: `serving`, `tokenizing`, `status`;
- what goes out: `openai`, `native` (response shapes), `sse` (streams);
- HTTP: `app`, `routes_openai`, `routes_native` (thin routes), `edges` (auth, CORS,
  shutdown), `deadlines` (transport), `logs`;
- the process: `launch`, `server`. `mtplib.commands.serve` only parses the command line
  and calls `launch`.
"""
