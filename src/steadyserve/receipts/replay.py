"""Replay receipts offline: load the model they name, run every receipt through one engine at once, compare bits.

A receipt is replayed only where this machine computes the bits it claims: the same weights (by sha256),
a batch-invariant fingerprint, a CPU device, and a numerics id this build computes for the receipt's own
numerics path (portable and int8 ids are the same on every x86-64 host; a host-path id only on the same
kind of machine). Anything else is "not reproducible here", never a mismatch. Receipts are replayed
together in one engine (the answer does not depend on it: each request's bits are batch-invariant), or one
at a time with `batched=False`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..kernel_versions import kv_format_named
from .format import Receipt, f32_bytes, f32_hex, f32_values, logprob_values

VERIFIED, MISMATCH, NOT_REPRODUCIBLE, INVALID = "verified", "mismatch", "not reproducible here", "invalid"


@dataclass
class Verdict:
    """What `steadyserve verify` reports for one receipt."""

    source: str  # the file (and index within it) the receipt came from
    status: str  # verified | mismatch | not reproducible here | invalid
    detail: str = ""  # one line: why, for anything but verified
    request_id: str = ""
    choice: int = 0
    # The first output token that differs: {"index", "receipt", "replay"} (a side that ended early is None).
    first_token: dict[str, Any] | None = None
    # The first logprob that differs: {"index", "where", "receipt", "replay", "receipt_bits", "replay_bits"}.
    first_logprob: dict[str, Any] | None = None
    numerics: str = ""  # the numerics path it was replayed on
    problems: list[str] = field(default_factory=list)  # the receipt's own inconsistencies (an altered hash)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Loaded:
    """A model loaded for one group of receipts and the engine that replays them (or why it could not be)."""

    engine: Any = None  # LLMEngine
    weights_sha256: str = ""
    numerics_id: str = ""
    mode: str = ""
    why_not: str = ""  # non-empty: every receipt of the group is not reproducible here, for this reason


def host_reason(r: Receipt, numerics_for: Callable[[str], Any]) -> str:
    """Why this machine cannot compute the receipt's bits before loading anything; "" when it may."""
    ident = r.identity
    if not ident.device.startswith("cpu"):
        return f"made on {ident.device}; this replay runs on the CPU (CUDA bits are the device's own)"
    if not ident.batch_invariant:
        return "made without batch invariance (fingerprint …-nbi): its bits depended on its batch"
    if ident.numerics_mode not in ("portable", "int8", "host"):
        return f"numerics path {ident.numerics_mode!r} is not one this build runs"
    if ident.numerics_mode in ("portable", "int8") and ident.dtype != "float32":
        return f"dtype {ident.dtype} on the {ident.numerics_mode} path is not one this build runs"
    try:
        here = numerics_for(ident.numerics_mode).numerics_id
    except Exception as e:  # the platform facts cannot be read
        return f"cannot compute this machine's numerics id: {e}"
    if here != ident.numerics_id:
        what = ("this machine (another CPU kind, library build or MKL mode)" if ident.numerics_mode == "host"
                else "this build (other kernel versions)")
        return (f"numerics {ident.numerics_mode} id {ident.numerics_id}, but {what} computes "
                f"{ident.numerics_mode} as {here}")
    if r.grammar_sha256 is not None and r.params.logprobs is None:
        return (f"its output was constrained by a grammar (sha256 {r.grammar_sha256[:12]}…), which a receipt names "
                "by hash but does not carry, and it has no logprobs to check by scoring the output")
    return ""


def compare(r: Receipt, out: Any) -> Verdict:
    """A receipt against its replay (an offline.Completed): verified, or the first token and logprob that differ."""
    v = Verdict(source="", status=VERIFIED, request_id=r.request_id, choice=r.choice, problems=list(r.problems))
    got, want = list(out.token_ids), r.output_token_ids
    if got != want:
        i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        v.first_token = {"index": i, "receipt": want[i] if i < len(want) else None,
                         "replay": got[i] if i < len(got) else None}
    replay_values = logprob_values(out.prompt_logprobs, out.logprobs)
    mine = f32_bytes(replay_values)
    if mine != r.logprob_bytes:
        theirs = f32_values(r.logprob_bytes)
        n = min(len(theirs), len(replay_values))
        i = next((k for k in range(n) if mine[4 * k:4 * k + 4] != r.logprob_bytes[4 * k:4 * k + 4]), n)
        a = theirs[i] if i < len(theirs) else None
        b = replay_values[i] if i < len(replay_values) else None
        v.first_logprob = {"index": i, "where": locate(out, i, len(theirs)), "receipt": a, "replay": b,
                           "receipt_bits": None if a is None else f32_hex(a),
                           "replay_bits": None if b is None else f32_hex(b)}
    parts = []
    if v.first_token is not None:
        t = v.first_token
        parts.append(f"output token {t['index']}: receipt {t['receipt']}, replay {t['replay']}"
                     + (f" ({len(want)} tokens in the receipt, {len(got)} replayed)" if len(want) != len(got) else ""))
    if out.finish_reason != r.finish_reason:
        parts.append(f"finish reason: receipt {r.finish_reason}, replay {out.finish_reason}")
    if v.first_logprob is not None:
        lp = v.first_logprob
        parts.append(f"logprob {lp['index']} ({lp['where']}): receipt {_num(lp['receipt'], lp['receipt_bits'])}, "
                     f"replay {_num(lp['replay'], lp['replay_bits'])}")
    parts += r.problems
    if parts:
        v.status, v.detail = MISMATCH, "; ".join(parts)
    return v


def _num(x: float | None, bits: str | None) -> str:
    return "none (ended)" if x is None else f"{x!r} (float32 bits {bits})"


def locate(out: Any, index: int, receipt_count: int) -> str:
    """Which logprob value `index` of the layout is, read from the replay's structure."""
    k = 0
    for label, lps, first in (("prompt token", out.prompt_logprobs or [], 0), ("output token", out.logprobs, 0)):
        for pos, lp in enumerate(lps, first):
            if lp is None:
                continue
            for j in range(1 + len(lp.top)):
                if k == index:
                    return f"{label} {pos} (id {lp.token_id}): " + ("its logprob" if j == 0 else f"top[{j - 1}]")
                k += 1
    return f"past the replay's {k} values (the receipt has {receipt_count})"


def load_group(model_path: str, r: Receipt, threads: int) -> Loaded:
    """Load `model_path` on the receipt's numerics path, dtype and attention kernel, and build an engine."""
    import torch

    from ..config import EngineConfig
    from ..engine.engine import LLMEngine
    from ..engine.kv_cache import activations_kv_dtype
    from ..engine.selftest import run_selftest
    from ..models.loader import LoadError, load_model
    from ..numerics import NumericsError

    ident = r.identity
    attention = "native" if ident.attention == "nat1" else "python"
    try:
        torch.set_num_threads(threads)
        loaded = load_model(model_path, "cpu", ident.dtype, numerics=ident.numerics_mode, attention=attention)
    except (LoadError, NumericsError) as e:
        return Loaded(why_not=f"cannot load {model_path or 'the default model'} on numerics "
                      f"{ident.numerics_mode}: {e}")
    num = loaded.numerics
    # The cache the receipt's server stored (its fingerprint names any format but the activations' own), not this
    # build's default for the path: a receipt keeps the format it was made with.
    kv = kv_format_named(ident.fingerprint) or activations_kv_dtype(loaded.dtype)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=512 * 1024**2, threads=threads,
                                            numerics=ident.numerics_mode, attention=attention,
                                            adaptive_threads=False, kv_cache_dtype=kv))
    selftest = run_selftest(engine)
    if not selftest.passed:
        return Loaded(why_not=f"the batch-invariance self-test failed on this machine: {selftest.detail}")
    return Loaded(engine=engine, weights_sha256=loaded.weights_hash, numerics_id=num.numerics_id if num else "",
                  mode=num.mode if num else "")


def identity_reason(r: Receipt, loaded: Loaded) -> str:
    """Why the loaded model cannot reproduce this receipt; "" when it can."""
    if loaded.why_not:
        return loaded.why_not
    if loaded.weights_sha256 != r.identity.weights_sha256:
        return (f"made with weights sha256 {r.identity.weights_sha256[:12]}…; the model loaded here has "
                f"{loaded.weights_sha256[:12]}… (pass --model with the receipt's model)")
    if loaded.numerics_id != r.identity.numerics_id:
        return f"numerics id {r.identity.numerics_id}; the model loaded here computes {loaded.numerics_id}"
    return ""


def replay(engine: Any, receipts: list[Receipt], batched: bool = True) -> list[Any]:
    """Each receipt's replay (offline.Completed), or a string saying why the engine refused it."""
    from ..engine.offline import run_requests
    from ..engine.sequence import Request
    from ..limits import Refused

    requests: list[Request | str] = []
    for i, r in enumerate(receipts):
        req = Request(f"receipt-{i}", list(r.prompt_token_ids), r.params) if r.grammar_sha256 is None \
            else forced_request(f"receipt-{i}", r)
        try:
            engine.check(req)
            requests.append(req)
        except Refused as e:
            requests.append(f"the engine refuses its request: {e}")
    ok = [q for q in requests if not isinstance(q, str)]
    done: dict[str, Any] = {}
    if batched:
        done = run_requests(engine, ok)
    else:
        for q in ok:
            done.update(run_requests(engine, [q]))
    return [q if isinstance(q, str) else done[q.request_id] if r.grammar_sha256 is None
            else forced_result(r, done[q.request_id]) for q, r in zip(requests, receipts)]


GRAMMAR_NOTE = ("constrained by a grammar that a receipt names only by hash: its logprobs were checked by scoring "
                "the output after the prompt (the same bits as generating it); the grammar's masks were not replayed")


def forced_request(request_id: str, r: Receipt) -> Any:
    """A grammar-constrained receipt, teacher-forced: its prompt and output scored as one prompt, with as many
    alternatives as either part reported (the first k of the top k' values are the top k)."""
    from ..engine.sequence import Request, SamplingParams

    k = max(r.params.logprobs or 0, r.params.prompt_logprobs or 0)
    return Request(request_id, list(r.prompt_token_ids) + list(r.output_token_ids),
                   SamplingParams(max_tokens=0, prompt_logprobs=k))


def forced_result(r: Receipt, scored: Any) -> Any:
    """The scoring of forced_request, laid out as the receipt's generation would be: the prompt's positions
    (when it reported prompt logprobs) and each output token's, each cut to the alternatives it reported."""
    from dataclasses import replace

    from ..engine.offline import Completed

    def cut(lps: list[Any], k: int | None) -> list[Any]:
        return [None if lp is None else replace(lp, top=lp.top[:k or 0]) for lp in lps]

    n = len(r.prompt_token_ids)
    lps = list(scored.prompt_logprobs or [])
    out = Completed(token_ids=list(r.output_token_ids), finish_reason=r.finish_reason)
    out.prompt_logprobs = cut(lps[:n], r.params.prompt_logprobs) if r.params.prompt_logprobs is not None else None
    out.logprobs = cut(lps[n:], r.params.logprobs)
    return out


def model_for(r: Receipt, model: str, hashes: dict[str, str]) -> str:
    """The model file to replay `r` with: --model when given, else a packaged model whose file hash is the
    receipt's (native paths hash the GGUF file itself); "" (the default model) when none matches."""
    if model:
        return model
    from ..models import known
    from ..models.loader import _sha256_files

    for name in known.KNOWN_MODELS:
        try:
            path = str(known.resolve(name))
        except LookupError:
            continue
        if path not in hashes:
            hashes[path] = _sha256_files([Path(path)])
        if hashes[path] == r.identity.weights_sha256:
            return path
    return ""


def verify(receipts: list[tuple[str, Receipt]], model: str = "", threads: int = 0, batched: bool = True,
           log: Callable[[str], None] = lambda _: None) -> list[Verdict]:
    """Replay every receipt; one Verdict each, in order. Receipts that share a model and numerics path are
    replayed through one engine, all at once when `batched`."""
    from ..cpu_budget import read_cpu_budget
    from ..platform_info import numerics_for

    threads = threads or read_cpu_budget(0).threads
    verdicts: list[Verdict | None] = [None] * len(receipts)
    groups: dict[tuple[str, str, str, str, str, str], list[int]] = {}
    hashes: dict[str, str] = {}
    for i, (src, r) in enumerate(receipts):
        why = host_reason(r, numerics_for)
        if why:
            verdicts[i] = Verdict(src, NOT_REPRODUCIBLE, why, r.request_id, r.choice)
            continue
        path = model_for(r, model, hashes)
        ident = r.identity
        key = (path, ident.numerics_mode, ident.dtype, ident.attention, ident.weights_sha256,
               kv_format_named(ident.fingerprint))  # one engine per KV format too
        groups.setdefault(key, []).append(i)
    for (path, mode, *_), members in groups.items():
        log(f"loading {path or 'the default model'} on numerics {mode} for {len(members)} receipt(s)")
        loaded = load_group(path, receipts[members[0]][1], threads)
        runnable = []
        for i in members:
            src, r = receipts[i]
            why = identity_reason(r, loaded)
            if why:
                verdicts[i] = Verdict(src, NOT_REPRODUCIBLE, why, r.request_id, r.choice)
            else:
                runnable.append(i)
        if not runnable:
            continue
        log(f"replaying {len(runnable)} receipt(s) {'together' if batched else 'one at a time'}")
        outs = replay(loaded.engine, [receipts[i][1] for i in runnable], batched)
        for i, out in zip(runnable, outs):
            src, r = receipts[i]
            if isinstance(out, str):
                verdicts[i] = Verdict(src, INVALID, out, r.request_id, r.choice)
                continue
            v = compare(r, out)
            v.source, v.numerics = src, f"{loaded.mode} ({loaded.numerics_id})"
            if r.grammar_sha256 is not None:
                v.detail = "; ".join(x for x in (v.detail, GRAMMAR_NOTE) if x)
            verdicts[i] = v
    return [v for v in verdicts if v is not None]
