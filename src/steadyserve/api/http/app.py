"""The HTTP application: OpenAI-compatible routes, health, metrics, WebSocket streaming.

Handlers only parse (inputs.py -> requests.build, shared with gRPC), admit and
encode the events of the request's channel (engine/channel.py). Model code runs on the engine
thread; the event loop only moves bytes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...limits import Refused
from ...platform_info import platform_info, row_tiles_of
from ..events import RequestChannel, sum_usage
from ..protocol import encode_prompt, render_chat
from ..receipts import HEADER as RECEIPT_HEADER, header_asks, receipts_of
from ..requests import admit, check_model
from ..responses_store import ResponseStore
from ..state import ServerState
from ..tracing import note_refusal
from .embeddings_routes import EmbeddingRequest, add_embeddings_routes
from .errors import error_response, refusal_response
from .inputs import build_from_body, client_request_id, read_json, validated
from .messages import MessagesRequest
from .messages_errors import anthropic_error, anthropic_refusal, is_messages_path
from .messages_routes import add_messages_routes
from .openai_format import Formatter, formatters, full_body, mean_logprob
from .responses import ResponsesRequest
from .responses_routes import add_responses_routes
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .sse import OpenAIChunks, SSEStream, collect_events
from .ws import websocket_stream


def create_app(state: ServerState) -> FastAPI:
    cfg = state.config.server
    app = FastAPI(title="steadyserve", version="1", docs_url=None, redoc_url=None)
    app.state.ss = state

    @app.exception_handler(Refused)
    async def _refused(request: Request, e: Refused) -> JSONResponse:
        """Every refusal of every route: counted under its reason, answered with its status."""
        if state.metrics is not None:
            state.metrics.rejected.labels(e.metric_reason).inc()
        note_refusal(e)
        if is_messages_path(request.url.path):  # Anthropic's Messages API answers in its own error shape
            return anthropic_refusal(e)
        return refusal_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods get OpenAI-style bodies too (Anthropic-style under /v1/messages)."""
        message = f"{e.detail}: {request.method} {request.url.path}"
        resp = anthropic_error(e.status_code, message) if is_messages_path(request.url.path) else \
            error_response(e.status_code, message, "invalid_request_error", None,
                           {404: "not_found", 405: "method_not_allowed"}.get(e.status_code))
        for k, v in (e.headers or {}).items():
            resp.headers[k] = v
        return resp

    async def run(request: Request, kind: str) -> Response:
        """Read, validate (requests.build, on the tokenizer thread), admit, then stream or collect."""
        body = await read_json(request, cfg.max_request_bytes)
        req = await state.run_tokenizer(build_from_body, state, body, kind, "http", client_request_id(request.scope),
                                        header_asks(request.headers.get(RECEIPT_HEADER)))
        channel = admit(state, req)
        fmts = formatters(req, state.model_name, str(state.fingerprint), state.loaded.tokenizer,
                          receipts_of(state, req))
        want_lp = req.output.logprobs  # asked for by the client (best_of asks the engine anyway, to rank)
        if req.stream:
            return SSEStream(channel, OpenAIChunks(fmts, want_lp, req.output.include_usage, req.num_samples),
                             cfg.stall_timeout)
        return await collect(request, channel, fmts, want_lp, req.num_samples, req.n)

    async def collect(request: Request, channel: RequestChannel, fmts: list[Formatter], want_lp: bool, n: int,
                      keep: int) -> Response:
        """Every choice's outputs, then one body; the first choice that fails decides the error instead."""
        events = await collect_events(request.receive, channel)
        if isinstance(events, Response):
            return events
        accs = events.accs
        if keep == n:
            return JSONResponse(full_body(fmts, accs, want_lp, n))
        # best_of: of each prompt's n samples, the `keep` with the highest mean log-probability per token.
        chosen_fmts, chosen_accs = [], []
        for start in range(0, len(accs), n):
            group = sorted(range(start, start + n), key=lambda i: -mean_logprob(accs[i]))[:keep]
            for rank, i in enumerate(group):
                fmts[i].index = start // n * keep + rank
                chosen_fmts.append(fmts[i])
                chosen_accs.append(accs[i])
        body = full_body(chosen_fmts, chosen_accs, want_lp, keep)
        body["usage"] = sum_usage(accs, n).usage()  # every sample was generated
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI-compatible text completion, streamed (`stream: true`, server-sent events) or whole.

        With `echo: true`, `logprobs: N` and `max_tokens: 0` it scores a prompt: the logprob of every prompt
        token given the ones before it. Refused with 429 and `Retry-After` when the server is at capacity.
        """
        return await run(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI-compatible chat completion: the messages are rendered with the model's chat template.

        Streamed (`stream: true`, server-sent events) or whole; 429 with `Retry-After` at capacity.
        """
        return await run(request, "chat")

    add_responses_routes(app, state, ResponseStore(cfg.responses_store_size))
    add_embeddings_routes(app, state)
    add_messages_routes(app, state)

    def tokenize(body: Any) -> dict[str, Any]:
        req = validated(TokenizeRequest, body)
        check_model(state, req.model)
        tok = state.loaded.tokenizer
        if req.messages is not None:
            ids = render_chat(tok, req.message_dicts())
        else:
            ids = encode_prompt(tok, req.prompt, add_special_tokens=req.add_special_tokens, allow_empty=True)
        return {"count": len(ids), "max_model_len": state.limits.context, "tokens": ids}

    def detokenize(body: Any) -> dict[str, Any]:
        req = validated(DetokenizeRequest, body)
        check_model(state, req.model)
        state.limits.check_prompt_ids(req.tokens, "tokens")
        return {"prompt": state.loaded.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """The token ids the completion endpoints would see: `{"prompt": text}` as /v1/completions encodes it,
        or `{"messages": [...]}` rendered with the chat template as /v1/chat/completions does. Answers
        `{"count", "max_model_len", "tokens"}` (vLLM's shape)."""
        body = await read_json(request, cfg.max_request_bytes)
        out = await state.run_tokenizer(tokenize, body)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        """Token ids back to text: `{"tokens": [...]}` gives `{"prompt": text}` (vLLM's shape)."""
        body = await read_json(request, cfg.max_request_bytes)
        out = await state.run_tokenizer(detokenize, body)
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model: id, context length, fingerprint, and the platform that computes its bits."""
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "steadyserve",
            "max_model_len": state.limits.context, "system_fingerprint": str(state.fingerprint),
            # The machine and library build that compute the responses (same facts as gRPC GetModelInfo).
            "platform": platform_info(row_tiles_of(state.loaded), state.memory.limit if state.memory else None,
                                      state.cpu).as_dict()}]}

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness: 200 while the process serves HTTP (no API key needed)."""
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness: 200 with the fingerprint when requests are admitted; 503 with a reason (draining, engine
        dead, self-test failed) and `Retry-After` otherwise. Load balancers route on it (no API key needed)."""
        if state.ready:
            return JSONResponse({"status": "ready", "system_fingerprint": str(state.fingerprint)})
        why = "draining" if state.draining else "engine dead" if not state.engine.alive else "self-test failed"
        return JSONResponse({"status": "not ready", "reason": why}, status_code=503,
                            headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics in the text format (see the metrics reference); the API key is needed only with
        --metrics-auth."""
        if state.metrics is None:
            return PlainTextResponse("metrics disabled\n", status_code=404)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.websocket("/v1/stream")
    async def ws(websocket: WebSocket) -> None:
        """Streaming over a WebSocket: send a completion or chat request body as one JSON text message.

        The server answers with one `{"type": "delta", "text", "token_ids", ...}` message per batch of
        tokens and ends with exactly one `{"type": "final", "finish_reason", "usage", ...}` or one
        `{"type": "error", "error": {...}}`; then it closes the socket. A browser, which cannot set
        headers, passes the API key as the subprotocol `bearer.<key>`.
        """
        await websocket_stream(websocket, state)

    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's spec plus the request bodies: the routes parse JSON by hand (to name bad fields and bound
    sizes), so FastAPI cannot see their pydantic models; describe them here for clients and fuzzers."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest),
                        ("/v1/responses", ResponsesRequest), ("/v1/embeddings", EmbeddingRequest),
                        ("/v1/messages", MessagesRequest),
                        ("/tokenize", TokenizeRequest),
                        ("/detokenize", DetokenizeRequest)):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(js.pop("$defs", {}))
        schemas[model.__name__] = js
        spec["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = spec
    return spec
