"""Start-up self-test: is this build, on this machine, batch-invariant?

The engine checks before it claims: a probe request alone, then the same probe
among other requests at another batch position with its prompt chunked
differently, then its generated tokens re-scored as a prompt. All logprobs
must be bitwise equal. On the host path invariance is an observation about
MKL on one machine, so the row counts are calibrated first. On the portable
path it holds by construction, and the kernels themselves are checked instead:
each weight format the model uses, multiplied by the vector build this CPU runs
and by the scalar reference build, one row and several, must agree bitwise.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from ..kernel_versions import KERNELS
from ..kernels.build import float_build, int8_build
from .engine import LLMEngine
from .offline import run_requests
from .sequence import Request, SamplingParams


PROBE_PROMPT = 8  # the probe's prompt tokens
PROBE_TOKENS = 4  # the tokens it generates, compared alone/batched and decode/prefill


@dataclass
class SelfTestResult:
    passed: bool  # every comparison bitwise equal
    detail: str  # one line for logs and the console
    seconds: float


def _probe(rid: str, ids: list[int], max_tokens: int) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0,
                                            prompt_logprobs=0 if max_tokens == 0 else None, ignore_eos=True))


def run_selftest(engine: LLMEngine, seed: int = 1234) -> SelfTestResult:
    t0 = time.perf_counter()
    model = engine.loaded.model
    if model.tiler.enabled:
        model.calibrate()
    rng = random.Random(seed)
    vocab = engine.loaded.args.vocab_size
    # Short on purpose: every prompt token is a full forward at the model's size (prefill tokens were most of the
    # test's time on large models), and the checks need only distinct batch positions, a step that mixes prefill
    # and decode, and a few decoded tokens, not long sequences. The others decode for 3+ tokens so that they are
    # still decoding when the probe arrives (step 2) and when the last one joins (step 3).
    prompt = [rng.randrange(vocab) for _ in range(PROBE_PROMPT)]
    gen = PROBE_TOKENS
    alone = run_requests(engine, [_probe("alone", prompt, gen)])["alone"]
    others = [_probe(f"o{i}", [rng.randrange(vocab) for _ in range(rng.randrange(2, 10))], rng.randrange(3, 6))
              for i in range(4)]
    # Arrives while others decode: a mixed prefill/decode step, at the end of the batch.
    mixed = run_requests(engine, others[:3], {2: [_probe("probe", prompt, gen)], 3: others[3:]})["probe"]
    scored = run_requests(engine, [_probe("score", prompt + alone.token_ids, 0)])["score"]
    problems = _kernel_problems(model) if model.native else []
    if alone.token_ids != mixed.token_ids or alone.logprob_values != mixed.logprob_values:
        problems.append("alone vs batched")
    if scored.prompt_logprob_values[-gen:] != alone.logprob_values:
        problems.append("decode vs prefill")
    secs = time.perf_counter() - t0
    if problems:
        return SelfTestResult(False, "batch variance detected: " + ", ".join(problems), secs)
    if model.native:
        isa = float_build()
        kernels = f"native matmul {KERNELS['matmul']} ({isa} build equal to the scalar reference)"
        if _has_packed(model):
            q8 = int8_build()
            kernels += f", int8 matmul {KERNELS['int8']} ({q8} build equal to the scalar reference)"
        kernels += f", attention {model.kernel_id}"
    else:
        kernels = (f"attention {model.kernel_id}; row counts {_ladder(model.tiler.tiles)}, "
                   f"LM head {_ladder(model.head_tiler.tiles)}")
    return SelfTestResult(True, f"bitwise equal alone/batched/prefill/decode; {kernels} ({secs:.2f} s)", secs)


def _matrices(model) -> list:  # noqa: ANN001 - a Transformer
    from ..kernels.quant import QMatrix

    experts = [w for lw in model.layers if getattr(lw, "moe", None) is not None for w in lw.moe.matrices()]
    return [m for m in [model.lm_head] + [w for lw in model.layers for w in vars(lw).values()] + experts
            if isinstance(m, QMatrix)]


def _has_packed(model) -> bool:  # noqa: ANN001 - a Transformer
    return any(p.packed for m in _matrices(model) for p in m.parts)


def _kernel_problems(model) -> list[str]:  # noqa: ANN001 - a Transformer; engine code does not import models
    """Each weight format of the model through this CPU's build and the scalar build, at 1, 20 and 40 rows (the int8
    family's AMX build runs one group of 16 rows from 16 rows on and reuses unpacked blocks across groups from 32,
    the rest of the rows in its VNNI build; fewer than 16 are all VNNI)."""
    parts = {}
    for m in _matrices(model):
        for p in m.parts:
            parts.setdefault(p.fmt, p)
    g = torch.Generator().manual_seed(7)
    problems = []
    for fmt, p in sorted(parts.items()):
        w = p.data[:32]
        x = torch.randn(40, p.k, generator=g)
        outs = []
        for isa, rows in ((-1, 40), (0, 40), (-1, 1), (-1, 20)):
            y = torch.empty(rows, w.shape[0])
            torch.ops.steadyserve.qmatmul_(x[:rows], w, fmt, y, 0, isa)
            outs.append(y)
        if not all(torch.equal(y, outs[1][:y.shape[0]]) for y in outs):  # each against the scalar build's rows
            problems.append(f"matmul kernels disagree on {p.format_name}")
    return problems


def _ladder(tiles: list[int]) -> str:
    """[1, 2, ..., 64]-style summary: the verified counts, runs of consecutive ones shortened."""
    parts, i = [], 0
    while i < len(tiles):
        j = i
        while j + 1 < len(tiles) and tiles[j + 1] == tiles[j] + 1:
            j += 1
        parts.append(str(tiles[i]) if j - i < 2 else f"{tiles[i]}-{tiles[j]}")
        i = j + 1
    return "[" + ",".join(parts) + "]"
