"""llama-server's routes: POST /completion (and /completions), /tokenize, /detokenize,
/apply-template; GET /health (and /v1/health), /props, /slots, /metrics. Thin: read the
body, hand it to the logic (`Generations`, `Tokenizer`, `mtplib.serve.status`), shape the
result (`mtplib.serve.native`, `mtplib.serve.sse`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mtplib.serve import status
from mtplib.serve.body import read_json
from mtplib.serve.native import native_body, pick_fields
from mtplib.serve.protocol import (
    DetokenizeRequest,
    NativeRequest,
    TemplateRequest,
    TokenizeRequest,
    prompts_of,
    validate,
)
from mtplib.serve.serving import Generations
from mtplib.serve.sse import SSE_HEADERS, native_stream
from mtplib.serve.tokenizing import Tokenizer


def native_router(gens: Generations, tok: Tokenizer) -> APIRouter:
    router = APIRouter()
    worker, cfg = gens.worker, gens.cfg

    @router.get("/health")
    @router.get("/v1/health")
    async def health() -> JSONResponse:
        code, body = status.health(worker)
        return JSONResponse(body, status_code=code)

    @router.post("/completion")
    @router.post("/completions")
    async def completion(request: Request) -> Response:
        data = await read_json(request, cfg.max_body_bytes)
        req = gens.parse(data, NativeRequest, "completion")
        assert isinstance(req, NativeRequest)
        running = await gens.start_all(req, prompts_of(req.prompt), request.is_disconnected,
                                       native=True)
        if req.stream:
            return StreamingResponse(native_stream(cfg, running, req),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        settings = {j.index: j.settings for j in running.jobs}
        bodies = [pick_fields(native_body(cfg, settings[out.index], req.return_tokens,
                                          out.text, out.tokens, out.metrics, out.end,
                                          out.n_prompt, out.prompt_text, out.probs,
                                          index=out.index), req.response_fields)
                  for out in await gens.collect_all(running, request.is_disconnected)]
        # several prompts or n: a list of results, as llama-server answers them
        return JSONResponse(bodies[0] if len(bodies) == 1 else bodies)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = validate(TokenizeRequest, await read_json(request, cfg.max_body_bytes))
        got = await tok.tokenize(req)
        if got.pieces is None:
            return {"tokens": got.tokens}
        return {"tokens": [{"id": t, "piece": p}
                           for t, p in zip(got.tokens, got.pieces, strict=True)]}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = validate(DetokenizeRequest, await read_json(request, cfg.max_body_bytes))
        return {"content": await tok.detokenize(req)}

    @router.post("/apply-template")
    async def apply_template(request: Request) -> dict:
        req = validate(TemplateRequest, await read_json(request, cfg.max_body_bytes))
        return {"prompt": tok.apply_template(req)}

    @router.get("/props")
    async def props() -> dict:
        return status.props_of(worker)

    @router.get("/slots")
    async def slots(fail_on_no_slot: int = 0) -> list:
        return status.slots_of(worker, bool(fail_on_no_slot))

    @router.get("/metrics")
    async def metrics() -> Response:
        # llama-server's content type and Process-Start-Time-Unix header
        return Response(status.metrics_of(worker), media_type="text/plain; version=0.0.4",
                        headers={"Process-Start-Time-Unix": str(worker.started_unix)})

    return router
