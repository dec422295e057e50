"""steadyserve.v1.Inference: Score, Generate, GetModelInfo and Tokenize on the shared engine.

Handlers parse, admit and format; model code runs on the engine thread. Each
RPC that reaches the engine is one engine request whose stream is registered
with the shared StreamRegistry, so drain and engine death end gRPC streams
exactly as they end HTTP ones. A request is aborted in the engine (its slot
freed at the next step) when its deadline passes, when the client cancels,
or when the client reads nothing for --stall-timeout.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc

from ...engine.engine import AdmissionError
from ...engine.sequence import MAX_LOGPROBS, SamplingParams, TokenLogprob
from ...platform_info import platform_info, row_tiles_of
from ..protocol import token_text
from ..state import ServerState
from ..streams import StreamHandle
from ..protos.steadyserve.v1 import inference_pb2 as pb
from ..protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc
from . import ERROR_CODE_KEY, ERROR_FIELD_KEY, FINGERPRINT_KEY, PUSHBACK_KEY, REQUEST_ID_KEY, RETRY_AFTER_KEY
from .inputs import BadInput, admission_field, check_common, generate_params, prompt_ids, score_params

Code = grpc.StatusCode

# Why a stream ended early (StreamHandle.error_for) -> the status the client gets.
END_STATUS = {
    "deadline": Code.DEADLINE_EXCEEDED,
    "client_disconnect": Code.CANCELLED,
    "drain_timeout": Code.UNAVAILABLE,  # nothing more will come from this replica
    "engine_error": Code.INTERNAL,  # the engine itself failed: the one use of INTERNAL
    "request_error": Code.ABORTED,  # this request failed in the engine (e.g. non-finite logits); others did not
    "stall": Code.ABORTED,
}
INLINE_TOKENIZE_CHARS = 2048  # shorter texts are tokenized on the loop (the high-rate Score path)
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


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
        self._token_text: dict[int, str] = {}  # decoded once per token id: Score is called at high rates
        # Tokenizing a 1 MB prompt or rendering a chat template takes seconds of CPU: never on the loop,
        # which moves every stream's bytes. One thread: HF tokenizers are not meant for concurrent use.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="steadyserve-grpc-tokenize")

    async def _prompt_ids(self, request: Any) -> tuple[list[int], str]:
        which = request.WhichOneof("input")
        if which == "chat" or (which == "text" and len(request.text) > INLINE_TOKENIZE_CHARS):
            return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, prompt_ids, self.state,
                                                                    request)
        return prompt_ids(self.state, request)  # short text, token ids: microseconds, not worth a thread hop

    # ---- shared steps ----------------------------------------------------
    async def _open(self, context: grpc.aio.ServicerContext, model: str = "", request_id: str = "") -> tuple[_Call, str]:
        """Refuse new work while draining or dead; validate the common fields; returns (call, request id)."""
        call = _Call(context, self.fingerprint)
        st = self.state
        if st.draining:  # the same refusal state.submit gives, for every rpc, not only those reaching the engine
            await self._refuse(call, AdmissionError("draining", "server is draining (shutting down); retry on "
                                                    "another replica", retry_after=5.0), "input")
        if not st.engine.alive:
            await self._refuse(call, AdmissionError("dead", "the engine is not running"), "input")
        try:
            rid = check_common(st, model, request_id)
        except BadInput as e:
            await self._invalid(call, e)
        call.set(REQUEST_ID_KEY, rid)
        return call, rid

    def _count_rejected(self, reason: str) -> None:
        if self.state.metrics is not None:
            self.state.metrics.rejected.labels(reason).inc()

    async def _invalid(self, call: _Call, e: BadInput) -> NoReturn:
        self._count_rejected("invalid")
        await call.abort(Code.INVALID_ARGUMENT, str(e), {ERROR_FIELD_KEY: e.field, ERROR_CODE_KEY: "invalid"})

    async def _submit(self, call: _Call, rid: str, ids: list[int], params: SamplingParams, input_field: str,
                      scoring: bool = False) -> StreamHandle:
        """Admit into the engine or abort the RPC at once with the refusal's status."""
        try:
            stream = self.state.submit(rid, ids, params, "grpc")
        except AdmissionError as e:
            await self._refuse(call, e, input_field, scoring)
        return self.state.streams.open_stream(rid, stream, "grpc")

    async def _refuse(self, call: _Call, e: AdmissionError, input_field: str, scoring: bool = False) -> NoReturn:
        """An admission refusal as a status: RESOURCE_EXHAUSTED, UNAVAILABLE or INVALID_ARGUMENT."""
        self._count_rejected(e.reason)
        if e.reason in ("overloaded", "draining", "dead"):
            ms = str(max(1, math.ceil((e.retry_after or 1.0) * 1000)))
            trailers = {ERROR_CODE_KEY: e.reason, RETRY_AFTER_KEY: ms}
            if e.reason == "overloaded":  # a retry policy waits this long; draining: retry elsewhere now
                trailers[PUSHBACK_KEY] = ms
            code = Code.RESOURCE_EXHAUSTED if e.reason == "overloaded" else Code.UNAVAILABLE
            await call.abort(code, str(e), trailers)
        field = admission_field(e.param, input_field, scoring)
        await call.abort(Code.INVALID_ARGUMENT, f"{field}: {e}", {ERROR_FIELD_KEY: field, ERROR_CODE_KEY: e.reason})

    def _arm_deadline(self, context: grpc.aio.ServicerContext, handle: StreamHandle) -> asyncio.TimerHandle | None:
        """Abort the engine request when the deadline passes, whether or not gRPC cancels this handler."""
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e8:  # no deadline (gRPC reports a huge number for "infinite")
            return None
        return asyncio.get_running_loop().call_later(max(0.0, remaining), handle.cut, "deadline")

    def _close(self, context: grpc.aio.ServicerContext, handle: StreamHandle, timer: asyncio.TimerHandle | None
               ) -> None:
        """End of an RPC's engine request, however the RPC ended: cancelled, failed or done."""
        if timer is not None:
            timer.cancel()
        if not handle.stream.finished:  # left before the engine finished: deadline, cancel, gone client
            handle.cut(self._cut_reason(context))  # counted once, by reason; the engine frees the slot next step
        handle.backlog_bytes = 0
        self.state.streams.close(handle)

    def _cut_reason(self, context: grpc.aio.ServicerContext) -> str:
        if deadline_passed(context):
            return "deadline"
        return "drain_timeout" if self.state.draining else "client_disconnect"

    async def _end_with_problem(self, call: _Call, problem: tuple[str, str]) -> NoReturn:
        code, message = problem
        await call.abort(END_STATUS.get(code, Code.ABORTED), message, {ERROR_CODE_KEY: code})

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = token_text(self.state.loaded.tokenizer, token_id)
        return text

    def _logprob(self, lp: TokenLogprob) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=lp.token_id, text=self._text(lp.token_id), logprob=lp.logprob,
                               top=[pb.TopLogprob(token_id=t, text=self._text(t), logprob=v) for t, v in lp.top])

    # ---- rpcs --------------------------------------------------------------
    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        call, rid = await self._open(context, request.model, request.request_id)
        try:
            ids, field = await self._prompt_ids(request)
            params = score_params(request)
        except BadInput as e:
            await self._invalid(call, e)
        handle = await self._submit(call, rid, ids, params, field, scoring=True)
        timer = self._arm_deadline(context, handle)
        last = None
        prompt_lps: list[TokenLogprob | None] | None = None
        try:
            async for out in handle.stream:
                if out.prompt_logprobs is not None:
                    prompt_lps = out.prompt_logprobs
                last = out
        finally:
            self._close(context, handle, timer)
        problem = handle.error_for(last) if last is not None else ("engine_error", "no output from the engine")
        if problem is None and prompt_lps is None:
            problem = ("engine_error", "the engine finished without prompt logprobs")
        if problem is not None:
            await self._end_with_problem(call, problem)
        tokens = [pb.TokenLogprob(token_id=ids[0], text=self._text(ids[0]))]
        tokens += [self._logprob(lp) for lp in prompt_lps[1:]]  # type: ignore[index, union-attr, arg-type]
        return pb.ScoreResponse(request_id=rid, tokens=tokens, fingerprint=self.fingerprint,
                                model=self.state.model_name, usage=pb.Usage(prompt_tokens=len(ids)))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        call, rid = await self._open(context, request.model, request.request_id)
        try:
            ids, field = await self._prompt_ids(request)
            params = generate_params(self.state, request)
        except BadInput as e:
            await self._invalid(call, e)
        handle = await self._submit(call, rid, ids, params, field)
        timer = self._arm_deadline(context, handle)
        want_lp = params.logprobs is not None
        try:
            async for batch in handle.batches():
                last = batch[-1]
                problem = handle.error_for(last) if last.finished else None
                if problem is not None and problem[0] == "client_disconnect":
                    return
                token_ids = [t for o in batch for t in o.new_token_ids]
                text = "".join(o.text_delta for o in batch)
                if token_ids or text:
                    lps = [self._logprob(lp) for o in batch for lp in o.logprobs] if want_lp else []
                    await self._write(context, handle, pb.GenerateResponse(
                        batch=pb.TokenBatch(token_ids=token_ids, text=text, logprobs=lps)))
                if problem is not None:
                    await self._end_with_problem(call, problem)
                if last.finished:
                    await self._write(context, handle, pb.GenerateResponse(final=pb.GenerateFinal(
                        finish_reason=FINISH.get(last.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
                        usage=pb.Usage(prompt_tokens=last.num_prompt_tokens,
                                       completion_tokens=last.num_generated_tokens,
                                       cached_prompt_tokens=last.num_cached_tokens),
                        request_id=rid, fingerprint=self.fingerprint, model=self.state.model_name)))
        except _ClientGone:
            return  # nobody to tell; `finally` counts why the stream ended
        except _Stalled:
            await self._end_with_problem(call, ("stall", "the client accepted no data for the stall timeout; "
                                                         "stream aborted"))
        finally:
            self._close(context, handle, timer)

    async def _write(self, context: grpc.aio.ServicerContext, handle: StreamHandle, msg: Any) -> None:
        """Send one stream message; cut the stream if the client takes nothing for --stall-timeout."""
        handle.backlog_bytes = msg.ByteSize()
        try:
            await asyncio.wait_for(context.write(msg), self.state.config.server.stall_timeout)
        except asyncio.TimeoutError:
            handle.cut("stall")
            raise _Stalled() from None
        except Exception:
            if context.cancelled():  # gRPC fails writes to a call the client cancelled (ExecuteBatchError)
                raise _ClientGone() from None
            raise
        handle.backlog_bytes = 0

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._open(context)
        st, fp = self.state, self.state.fingerprint
        return pb.ModelInfo(model=st.model_name, context_length=st.loaded.max_model_len, fingerprint=self.fingerprint,
                            device=fp.device, dtype=fp.dtype, batch_invariant=fp.batch_invariant,
                            architecture=st.loaded.args.architecture, vocab_size=st.loaded.args.vocab_size,
                            max_tokens_cap=st.config.server.max_tokens_cap, max_logprobs=MAX_LOGPROBS,
                            weights_hash=fp.weights, platform=_platform_pb(st.loaded))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        call, _ = await self._open(context)
        try:
            ids, _field = await self._prompt_ids(request)
        except BadInput as e:
            await self._invalid(call, e)
        return pb.TokenizeResponse(token_ids=ids, tokens=[self._text(t) for t in ids],
                                   context_length=self.state.loaded.max_model_len)


class _Stalled(Exception):
    pass


class _ClientGone(Exception):
    pass


def _platform_pb(loaded) -> pb.PlatformInfo:
    p = platform_info(row_tiles_of(loaded))
    return pb.PlatformInfo(cpu_model=p.cpu_model, cpu_flags=list(p.cpu_flags), num_cpus=p.num_cpus, isa=p.isa,
                           torch_version=p.torch_version, mkl_version=p.mkl_version, mkl_cbwr=p.mkl_cbwr,
                           mkl_enable_instructions=p.mkl_enable_instructions, row_tiles=list(p.row_tiles),
                           numerics=p.numerics.mode if p.numerics else "",
                           numerics_id=p.numerics.numerics_id if p.numerics else "")
