"""The HTTP application: OpenAI-compatible routes, health, metrics, WebSocket streaming.

Handlers only parse, admit and format. Model code runs on the engine thread;
the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine.engine import AdmissionError
from ...engine.sequence import InvalidRequest
from ...platform_info import platform_info, row_tiles_of
from ..protocol import encode_prompt, render_chat
from ..state import ServerState
from .errors import admission_response, error_response
from .inputs import BadRequest, Prepared, derived_seed, find_surrogate, read_json, submit_unique_all, validation_message
from .openai_format import Accumulated, Formatter, full_body, mean_logprob, sum_usage
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, refuse_unsupported
from .sse import SSEResponse
from .ws import websocket_stream


def create_app(state: ServerState) -> FastAPI:
    cfg = state.config.server
    app = FastAPI(title="steadyserve", version="1", docs_url=None, redoc_url=None)
    app.state.ss = state

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, e: BadRequest) -> JSONResponse:
        if state.metrics is not None:
            state.metrics.rejected.labels("invalid").inc()
        return error_response(e.status, str(e), "invalid_request_error", e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods get OpenAI-style bodies too."""
        resp = error_response(e.status_code, f"{e.detail}: {request.method} {request.url.path}",
                              "invalid_request_error", None,
                              {404: "not_found", 405: "method_not_allowed"}.get(e.status_code))
        for k, v in (e.headers or {}).items():
            resp.headers[k] = v
        return resp

    def check_model(name: str | None) -> None:
        if name not in (None, "", state.model_name):
            raise BadRequest(404, f"model {name!r} does not exist; this server serves {state.model_name!r}",
                             "model", "model_not_found")

    def refuse(e: AdmissionError) -> JSONResponse:
        if state.metrics is not None:
            state.metrics.rejected.labels(e.reason).inc()
        return admission_response(e)

    def prepare(body: Any, kind: str) -> Prepared:
        """Validate a request body into one engine request per prompt. Raises BadRequest or AdmissionError."""
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        bad = find_surrogate(body)
        if bad is not None:
            raise BadRequest(400, f"{bad}: contains an unpaired UTF-16 surrogate escape; not valid Unicode", bad,
                             "invalid_unicode")
        try:
            refuse_unsupported(body)
            req = model_cls.model_validate(body)
            check_model(req.model)
            params = req.sampling_params(min(cfg.max_tokens_cap, 16 if kind == "completion" else 512))
            if params.max_tokens > cfg.max_tokens_cap:
                name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
                raise InvalidRequest(name, f"{name} must be at most {cfg.max_tokens_cap} (--max-tokens-cap)")
            tok = state.loaded.tokenizer
            context = state.loaded.max_model_len
            if kind == "chat":
                prompt_ids = render_chat(tok, req.message_dicts())  # type: ignore[union-attr]
                if len(prompt_ids) >= context:
                    raise InvalidRequest("messages", f"messages render to {len(prompt_ids)} tokens; the context "
                                         f"length is {context} tokens, prompt and completion together")
                prompts, texts = [prompt_ids], [""]  # type: list[list[int]], list[str | None]
            else:
                items = req.prompt_list()  # type: ignore[union-attr]
                if len(items) > state.engine.capacity:
                    raise InvalidRequest("prompt", f"prompt: at most {state.engine.capacity} prompts per request "
                                         "(--max-num-seqs + --max-queue), all admitted at once")
                prompts = [encode_prompt(tok, item, context, "prompt" if len(items) == 1 else f"prompt[{i}]")
                           for i, item in enumerate(items)]
                texts = [item if isinstance(item, str) else None for item in items]  # token ids: decoded for echo
            if params.grammar is not None:  # compiled here, off the event loop; admission then finds it known
                why = state.engine.engine.grammars.error(params.grammar)
                if why:
                    raise InvalidRequest("response_format", f"response_format: {why}")
            k = req.num_samples  # choices generated per prompt: n, or best_of
            if len(prompts) * k > state.engine.capacity:
                name = "best_of" if k > req.n else "n"
                raise InvalidRequest(name, f"{name}: {len(prompts)} prompt(s) x {k} choices is more than the "
                                     f"{state.engine.capacity} requests this server admits at once")
            if k > req.n and params.logprobs is None:
                params.logprobs = 0  # ranking needs each sampled token's logprob; the response leaves them out
            choices, choice_params, choice_texts = [], [], []
            for ids, text in zip(prompts, texts):
                for j in range(k):  # choice j of a prompt samples with seed + j: choice 0 is the n=1 request
                    p = dataclasses.replace(params, stop=list(params.stop), logit_bias=dict(params.logit_bias),
                                            seed=derived_seed(params.seed, j))
                    if req.requested_max_tokens is None:
                        # No max_tokens given: the default, but never more than the context leaves.
                        p.max_tokens = max(1, min(p.max_tokens, context - len(ids)))
                    choices.append(ids)
                    choice_params.append(p)
                    choice_texts.append(text)
        except ValidationError as e:
            msg, param = validation_message(e)
            raise BadRequest(400, msg, param, "invalid_value") from None
        except (InvalidRequest, ValueError, TypeError) as e:
            raise BadRequest(400, str(e), getattr(e, "param", None), "invalid_value") from None
        return Prepared(req, choices, choice_params, choice_texts, k, req.n)

    # Tokenizing and chat-template rendering take time proportional to the body (seconds for a
    # megabyte): they run on one helper thread (the tokenizer releases the GIL), never on the loop.
    # One thread: HF tokenizers are not meant to be used from several threads at once.
    tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="steadyserve-tokenize")

    async def prepare_off_loop(body: Any, kind: str) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, prepare, body, kind)

    async def run(request: Request, kind: str) -> Response:
        body = await read_json(request, cfg.max_request_bytes)
        try:
            prep = await prepare_off_loop(body, kind)
        except AdmissionError as e:
            return refuse(e)
        tok = state.loaded.tokenizer
        request_id = request.scope["state"]["request_id"]
        num_choices = len(prep.prompts)
        engine_ids = [request_id] if num_choices == 1 else [f"{request_id}-{i}" for i in range(num_choices)]
        try:
            streams = submit_unique_all(state, engine_ids, prep.prompts, prep.params, "http")
        except AdmissionError as e:
            return refuse(e)
        req = prep.req
        echo = kind == "completion" and req.echo
        # Echo: a text prompt as sent; token ids decoded (only now: the engine has checked they are valid ids).
        fmts = [Formatter(kind, request_id, state.model_name, str(state.fingerprint), tok,
                          echo_prompt_ids=ids if echo else None,
                          echo_text=(text if text is not None else tok.decode(ids)) if echo else "", index=i)
                for i, (ids, text) in enumerate(zip(prep.prompts, prep.echo_texts))]
        # Asked for by the client (best_of asks the engine for them anyway, to rank its samples).
        want_lp = req.logprobs is not None if kind == "completion" else bool(req.logprobs)
        handles = [state.streams.open_stream(rid, st, "http") for rid, st in zip(engine_ids, streams)]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(handles, fmts, want_lp, include_usage, cfg.stall_timeout, n=prep.n)
        return await collect(request, handles, fmts, want_lp, prep.n, prep.keep)

    async def collect(request: Request, handles: list, fmts: list[Formatter], want_lp: bool, n: int,
                      keep: int) -> Response:
        """Every choice's outputs, then one body; the first choice that failed decides the error instead."""
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for h in handles:
                h.cut("client_disconnect")

        async def drain(handle, acc: Accumulated):
            last = None
            async for out in handle.stream:
                acc.add(out)
                last = out
            return last

        watcher = asyncio.create_task(watch())
        accs = [Accumulated() for _ in handles]
        try:
            lasts = await asyncio.gather(*(drain(h, a) for h, a in zip(handles, accs)))
        finally:
            watcher.cancel()
            for h in handles:
                h.stream.abort()
                state.streams.close(h)
        for handle, last in zip(handles, lasts):
            problem = handle.error_for(last) if last is not None else ("engine_error", "no output")
            if problem is not None:
                code, message = problem
                # 499 (client closed request, as nginx logs it): the client is gone and no server fault occurred.
                status = {"request_error": 400, "drain_timeout": 503, "client_disconnect": 499}.get(code, 500)
                return error_response(status, message, "server_error" if status >= 500 else "invalid_request_error",
                                      None, code)
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

    def tokenize(body: Any) -> dict[str, Any]:
        try:
            req = TokenizeRequest.model_validate(body)
            check_model(req.model)
            tok = state.loaded.tokenizer
            if req.messages is not None:
                ids = render_chat(tok, req.message_dicts())
            else:
                ids = list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        except ValidationError as e:
            msg, param = validation_message(e)
            raise BadRequest(400, msg, param, "invalid_value") from None
        except InvalidRequest as e:
            raise BadRequest(400, str(e), e.param, "invalid_value") from None
        return {"count": len(ids), "max_model_len": state.loaded.max_model_len, "tokens": ids}

    def detokenize(body: Any) -> dict[str, Any]:
        try:
            req = DetokenizeRequest.model_validate(body)
            check_model(req.model)
        except ValidationError as e:
            msg, param = validation_message(e)
            raise BadRequest(400, msg, param, "invalid_value") from None
        vocab = state.loaded.args.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(400, f"tokens[{bad}]: {req.tokens[bad]} is not a token id of this model (0..{vocab - 1})",
                             f"tokens[{bad}]", "invalid_value")
        return {"prompt": state.loaded.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """The token ids the completion endpoints would see: `{"prompt": text}` as /v1/completions encodes it,
        or `{"messages": [...]}` rendered with the chat template as /v1/chat/completions does. Answers
        `{"count", "max_model_len", "tokens"}` (vLLM's shape)."""
        body = await read_json(request, cfg.max_request_bytes)
        out = await asyncio.get_running_loop().run_in_executor(tokenize_pool, tokenize, body)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        """Token ids back to text: `{"tokens": [...]}` gives `{"prompt": text}` (vLLM's shape)."""
        body = await read_json(request, cfg.max_request_bytes)
        out = await asyncio.get_running_loop().run_in_executor(tokenize_pool, detokenize, body)
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model: id, context length, fingerprint, and the platform that computes its bits."""
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "steadyserve",
            "max_model_len": state.loaded.max_model_len, "system_fingerprint": str(state.fingerprint),
            # The machine and library build that compute the responses (same facts as gRPC GetModelInfo).
            "platform": platform_info(row_tiles_of(state.loaded)).as_dict()}]}

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
        await websocket_stream(websocket, state, run_prepare=prepare_ws)

    async def prepare_ws(body: Any) -> tuple[str, list[int], Any, Formatter | None]:
        """Validate a WS request body; returns (kind, prompt_ids, params). Raises BadRequest."""
        kind = "chat" if isinstance(body, dict) and "messages" in body else "completion"
        try:
            prep = await prepare_off_loop(body, kind)
        except AdmissionError as e:
            raise BadRequest(400, str(e), e.param, e.reason) from None
        if prep.n != 1:
            raise BadRequest(400, "n: the WebSocket streams one choice per request; send n 1 (or leave it out)",
                             "n", "invalid_value")
        if len(prep.prompts) != 1:
            raise BadRequest(400, "prompt: the WebSocket streams one prompt per request; send a string or one "
                             "list of token ids", "prompt", "invalid_value")
        return kind, prep.prompts[0], prep.params[0], None

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
                        ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(js.pop("$defs", {}))
        schemas[model.__name__] = js
        spec["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = spec
    return spec
