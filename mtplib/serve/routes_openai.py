"""OpenAI's routes: POST /v1/completions, /v1/chat/completions (and /chat/completions),
GET /v1/models (and /models). Thin: read the body, hand it to `Generations`, shape the
result (`mtplib.serve.openai`, `mtplib.serve.sse`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mtplib.serve.body import read_json
from mtplib.serve.chat import render_chat
from mtplib.serve.openai import Shape, merge_choices
from mtplib.serve.protocol import BaseRequest, ChatRequest, CompletionRequest, prompts_of
from mtplib.serve.serving import Generations
from mtplib.serve.sse import SSE_HEADERS, openai_stream
from mtplib.serve.status import model_card


async def respond(request: Request, gens: Generations, req: BaseRequest,
                  prompts: list[str | list[int | str]], shape: Shape) -> Response:
    """Run ``req`` (every prompt, ``n`` choices each) and answer it whole, or as a stream
    of chunks."""
    running = await gens.start_all(req, prompts, request.is_disconnected)
    if req.stream:
        return StreamingResponse(openai_stream(running, req, shape),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    bodies = []
    for out in await gens.collect_all(running, request.is_disconnected):
        body = shape.whole(out.text, out.finish, out.n_prompt, out.tokens, out.metrics,
                           out.probs, out.end, index=out.index)
        if req.return_tokens:
            body["tokens"] = out.tokens
            body["choices"][0]["tokens"] = out.tokens
        bodies.append(body)
    if len(bodies) == 1:
        bodies[0]["choices"][0].pop("tokens", None)
        return JSONResponse(bodies[0])
    return JSONResponse(merge_choices(bodies, req.n_choices()))


def openai_router(gens: Generations) -> APIRouter:
    router = APIRouter()
    cfg = gens.cfg

    def shape(chat: bool) -> Shape:
        return Shape(cfg.model_id, chat=chat, fingerprint=cfg.fingerprint)

    @router.get("/v1/models")
    @router.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(gens.worker)]}

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        data = await read_json(request, cfg.max_body_bytes)
        req = gens.parse(data, CompletionRequest, "completions")
        assert isinstance(req, CompletionRequest)
        return await respond(request, gens, req, prompts_of(req.prompt), shape(False))

    @router.post("/v1/chat/completions")
    @router.post("/chat/completions")
    async def chat(request: Request) -> Response:
        data = await read_json(request, cfg.max_body_bytes)
        req = gens.parse(data, ChatRequest, "chat")
        assert isinstance(req, ChatRequest)
        return await respond(request, gens, req, [render_chat(cfg, req.messages)],
                             shape(True))

    return router
