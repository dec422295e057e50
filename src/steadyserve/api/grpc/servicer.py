"""steadyserve.v1.Inference: Score, Generate, GetModelInfo, Tokenize and Embed on the shared engine.

Handlers turn a message into a RequestSpec (inputs.py), validate it with the
HTTP API's builder (requests.build), admit it, and encode the events of its
channel (engine/channel.py) as messages; model code runs on the engine thread.
Each RPC that reaches the engine has one channel, held by the server's open
channels (api/streams.py), so drain and engine death end gRPC streams
exactly as they end HTTP ones. A request is aborted in the engine (its slot
freed at the next step) when its deadline passes, when the client cancels,
or when the client reads nothing for --stall-timeout.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, NoReturn

import grpc

from ...engine.sequence import TokenLogprob
from ...limits import MAX_LOGPROBS, RATE_REASONS, RETRY_REASONS, Refused
from ...platform_info import platform_info, row_tiles_of
from ..embeddings import admit_embed, build_embed, vectors
from ..events import RequestChannel, StreamStalled, end_status
from ..protocol import token_text
from ..receipts import HEADER as RECEIPT_HEADER, header_asks, receipt_for
from ..requests import RequestSpec, ValidatedRequest, admit, build, prompt_ids
from ..state import ServerState
from ..streams import END_MESSAGES
from ..tools import tool_turn
from ..tracing import note_refusal
from ..protos.steadyserve.v1 import inference_pb2 as pb
from ..protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc
from . import ERROR_CODE_KEY, ERROR_FIELD_KEY, FINGERPRINT_KEY, PUSHBACK_KEY, REQUEST_ID_KEY, RETRY_AFTER_KEY
from .inputs import embed_field_name, embed_spec, field_name, generate_spec, score_spec, tokenize_spec

Code = grpc.StatusCode

INLINE_TOKENIZE_CHARS = 2048  # shorter texts are tokenized on the loop (the high-rate Score path)
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
          "tool_calls": pb.FINISH_REASON_TOOL_CALLS}


# A client whose deadline passes cancels the call itself (RST_STREAM), a little before the server's
# copy of the deadline runs out: a cancel this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.5


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


class _Call:
    """One RPC's trailing metadata, kept whole so that every exit path sends all of it."""

    def __init__(self, context: grpc.aio.ServicerContext, fingerprint: str) -> None:
        self.context = context
        self.trailers: dict[str, str] = {FINGERPRINT_KEY: fingerprint}
        context.set_trailing_metadata(tuple(self.trailers.items()))

    def set(self, key: str, value: str) -> None:
        self.trailers[key] = value
        self.context.set_trailing_metadata(tuple(self.trailers.items()))

    async def abort(self, code: grpc.StatusCode, message: str, extra: dict[str, str] | None = None) -> NoReturn:
        self.trailers.update(extra or {})
        await self.context.abort(code, message, trailing_metadata=tuple(self.trailers.items()))
        raise AssertionError("unreachable: context.abort raises")


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.fingerprint = str(state.fingerprint)

    # ---- shared steps ----------------------------------------------------
    async def _validate(self, call: _Call, msg: Any, spec_of: Callable[[Any], RequestSpec]) -> ValidatedRequest:
        """requests.build on the message (on the tokenizer thread unless it is short), or abort the RPC."""
        try:
            spec = spec_of(msg)
            if not spec.receipt:  # a client that cannot set the field: the x-steadyserve-receipt metadata
                spec.receipt = any(k == RECEIPT_HEADER and header_asks(v)
                                   for k, v in call.context.invocation_metadata() or ())
            which = msg.WhichOneof("input")
            if which == "chat" or (which == "text" and len(msg.text) > INLINE_TOKENIZE_CHARS):
                req = await self.state.run_tokenizer(build, self.state, spec)
            else:  # short text, token ids: microseconds, not worth a thread hop
                req = build(self.state, spec)
        except Refused as e:
            await self._refuse(call, e, msg)
        call.set(REQUEST_ID_KEY, req.request_id)
        return req

    async def _admit(self, call: _Call, req: ValidatedRequest, msg: Any) -> RequestChannel:
        """Admit into the engine or abort the RPC at once with the refusal's status (naming msg's field)."""
        try:
            return admit(self.state, req)
        except Refused as e:
            await self._refuse(call, e, msg)

    async def _refuse(self, call: _Call, e: Refused, msg: Any = None) -> NoReturn:
        """A refusal as a status: RESOURCE_EXHAUSTED (overloaded, a tenant's own limit), UNAVAILABLE (draining,
        dead) or INVALID_ARGUMENT naming the proto field, with the HTTP API's message."""
        if self.state.metrics is not None:
            self.state.metrics.rejected.labels(e.metric_reason).inc()
        note_refusal(e)
        if e.reason in RETRY_REASONS:
            ms = str(max(1, math.ceil((e.retry_after or 1.0) * 1000)))
            trailers = {ERROR_CODE_KEY: e.reason, RETRY_AFTER_KEY: ms}
            if e.reason in RATE_REASONS:  # a retry policy waits this long; draining: retry elsewhere now
                trailers[PUSHBACK_KEY] = ms
            code = Code.RESOURCE_EXHAUSTED if e.reason in RATE_REASONS else Code.UNAVAILABLE
            await call.abort(code, str(e), trailers)
        if isinstance(msg, pb.EmbedRequest):
            field = embed_field_name(e.param, msg)
        else:
            field = field_name(e.param, msg, scoring=isinstance(msg, pb.ScoreRequest)) if msg is not None else "input"
        await call.abort(Code.INVALID_ARGUMENT, e.message_for(field), {ERROR_FIELD_KEY: field,
                                                                       ERROR_CODE_KEY: e.reason})

    def _watch(self, context: grpc.aio.ServicerContext, channel: RequestChannel) -> RequestChannel:
        """The request's channel, cut at the deadline and when the handler leaves early (cancel, gone client)."""
        remaining = context.time_remaining()
        deadline = None if remaining is None or remaining > 1e8 else remaining  # gRPC's "infinite" is huge
        return channel.watch(deadline_s=deadline, unfinished_reason=lambda: self._cut_reason(context))

    def _cut_reason(self, context: grpc.aio.ServicerContext) -> str:
        if deadline_passed(context):
            return "deadline"
        return "drain_timeout" if self.state.draining else "client_disconnect"

    async def _end_with_problem(self, call: _Call, problem: tuple[str, str]) -> NoReturn:
        code, message = problem
        await call.abort(getattr(Code, end_status(code).grpc), message, {ERROR_CODE_KEY: code})

    def _text(self, token_id: int) -> str:
        return token_text(self.state.loaded.tokenizer, token_id)  # memoized there: Score runs at high rates

    def _logprob(self, lp: TokenLogprob) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=lp.token_id, text=self._text(lp.token_id), logprob=lp.logprob,
                               top=[pb.TopLogprob(token_id=t, text=self._text(t), logprob=v) for t, v in lp.top])

    # ---- rpcs --------------------------------------------------------------
    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        call = _Call(context, self.fingerprint)
        req = await self._validate(call, request, score_spec)
        events = await self._watch(context, await self._admit(call, req, request)).drain()
        problem = events.error
        prompt_lps = events.accs[0].prompt_logprobs
        if problem is None and prompt_lps is None:
            problem = ("engine_error", "the engine finished without prompt logprobs")
        if problem is not None:
            await self._end_with_problem(call, problem)
        ids = req.prompts[0]
        tokens = [pb.TokenLogprob(token_id=ids[0], text=self._text(ids[0]))]
        tokens += [self._logprob(lp) for lp in prompt_lps[1:]]  # type: ignore[index, union-attr, arg-type]
        return pb.ScoreResponse(request_id=req.request_id, tokens=tokens, fingerprint=self.fingerprint,
                                model=self.state.model_name, usage=pb.Usage(prompt_tokens=len(ids)),
                                receipt=self._receipt(req, events))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        call = _Call(context, self.fingerprint)
        req = await self._validate(call, request, generate_spec)
        channel = await self._admit(call, req, request)
        want_lp = req.params[0].logprobs is not None

        async def write(msg: pb.GenerateResponse) -> None:
            """Send one stream message; the stream is cut if the client takes nothing for --stall-timeout."""
            try:
                await channel.send(context.write(msg), msg.ByteSize(), self.state.config.server.stall_timeout)
            except StreamStalled:
                raise
            except Exception:
                if context.cancelled():  # gRPC fails writes to a call the client cancelled (ExecuteBatchError)
                    raise _ClientGone() from None
                raise

        try:
            async with self._watch(context, channel):
                async for ev in channel:
                    if ev.error is not None and ev.error[0] == "client_disconnect":
                        return
                    token_ids, text = ev.token_ids, ev.text
                    if token_ids or text:
                        lps = [self._logprob(lp) for o in ev.outputs for lp in o.logprobs] if want_lp else []
                        await write(pb.GenerateResponse(batch=pb.TokenBatch(token_ids=token_ids, text=text,
                                                                            logprobs=lps)))
                    if ev.error is not None:
                        await self._end_with_problem(call, ev.error)
                    if ev.finished:
                        last = ev.last
                        final = pb.GenerateFinal(
                            finish_reason=FINISH.get(last.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
                            usage=pb.Usage(prompt_tokens=last.num_prompt_tokens,
                                           completion_tokens=last.num_generated_tokens,
                                           cached_prompt_tokens=last.num_cached_tokens),
                            request_id=req.request_id, fingerprint=self.fingerprint, model=self.state.model_name)
                        if req.tool_format is not None:
                            self._tool_final(final, req, channel.accs[0].text, last.finish_reason)
                        final.receipt = self._receipt(req, channel)
                        await write(pb.GenerateResponse(final=final))
        except _ClientGone:
            return  # nobody to tell; leaving the channel counts why the stream ended
        except StreamStalled:
            await self._end_with_problem(call, ("stall", END_MESSAGES["stall"]))

    def _receipt(self, req: ValidatedRequest, channel: RequestChannel) -> str:
        """The one choice's receipt as JSON text, or "" when none was asked for."""
        if not req.receipt:
            return ""
        return json.dumps(receipt_for(self.state, req, 0, channel.accs[0]), separators=(",", ":"))

    @staticmethod
    def _tool_final(final: pb.GenerateFinal, req: ValidatedRequest, text: str, reason: str | None) -> None:
        """The output read as every transport reads it (tools.tool_turn): content, tool_calls, finish reason."""
        turn = tool_turn(req.tool_format, text, req.request_id, 0, reason)  # type: ignore[arg-type]
        for call in turn.tool_calls:
            final.tool_calls.add(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
        if turn.content is not None:
            final.content = turn.content
        final.finish_reason = FINISH.get(turn.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        call = _Call(context, self.fingerprint)
        try:
            self.state.refuse_if_closed()
        except Refused as e:
            await self._refuse(call, e)
        st, fp = self.state, self.state.fingerprint
        return pb.ModelInfo(model=st.model_name, context_length=st.limits.context, fingerprint=self.fingerprint,
                            device=fp.device, dtype=fp.dtype, batch_invariant=fp.batch_invariant,
                            architecture=st.loaded.args.architecture, vocab_size=st.limits.vocab_size,
                            max_tokens_cap=st.config.server.max_tokens_cap, max_logprobs=MAX_LOGPROBS,
                            weights_hash=fp.weights, platform=_platform_pb(st))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        call = _Call(context, self.fingerprint)
        try:
            self.state.refuse_if_closed()
            ids = (await self.state.run_tokenizer(prompt_ids, self.state, tokenize_spec(request)))[0][0]
        except Refused as e:
            await self._refuse(call, e, request)
        return pb.TokenizeResponse(token_ids=ids, tokens=[self._text(t) for t in ids],
                                   context_length=self.state.limits.context)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        call = _Call(context, self.fingerprint)
        try:
            req = await self.state.run_tokenizer(build_embed, self.state, embed_spec(request))
            call.set(REQUEST_ID_KEY, req.request_id)
            channel = admit_embed(self.state, req)
        except Refused as e:
            await self._refuse(call, e, request)
        events = await self._watch(context, channel).drain()
        vecs = vectors(self.state, req, events.accs) if events.error is None else None
        if vecs is None:
            await self._end_with_problem(call, events.error or ("engine_error", "the engine finished an embedding "
                                                                               "without its vector"))
        return pb.EmbedResponse(request_id=req.request_id, fingerprint=self.fingerprint, model=self.state.model_name,
                                embeddings=[pb.Embedding(values=v, prompt_tokens=len(p))
                                            for v, p in zip(vecs, req.prompts)],  # type: ignore[arg-type]
                                usage=pb.Usage(prompt_tokens=req.num_prompt_tokens))


class _ClientGone(Exception):
    pass


def _platform_pb(state) -> pb.PlatformInfo:
    p = platform_info(row_tiles_of(state.loaded), state.memory.limit if state.memory else None, state.cpu)
    return pb.PlatformInfo(cpu_model=p.cpu_model, cpu_flags=list(p.cpu_flags), num_cpus=p.num_cpus, isa=p.isa,
                           torch_version=p.torch_version, mkl_version=p.mkl_version, mkl_cbwr=p.mkl_cbwr,
                           mkl_enable_instructions=p.mkl_enable_instructions, row_tiles=list(p.row_tiles),
                           numerics=p.numerics.mode if p.numerics else "",
                           numerics_id=p.numerics.numerics_id if p.numerics else "",
                           memory_limit_bytes=p.memory_limit_bytes, memory_limit_source=p.memory_limit_source,
                           threads=p.threads, threads_source=p.threads_source, cpu_quota=p.cpu_quota,
                           cpu_affinity=p.cpu_affinity)
