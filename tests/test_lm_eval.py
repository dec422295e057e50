"""The real lm-evaluation-harness against steadyserve, and against transformers on the same model and tasks.

Three small local tasks, written by the test: multiple choice (loglikelihood; lm-eval's `local-completions`
sends batched token-id prompts with echo, logprobs and max_tokens), rolling perplexity over documents longer
than one window (loglikelihood_rolling) and greedy generation through `local-chat-completions`
(generate_until, with the chat template). The scores must equal those of `--model hf`: accuracies and
generated strings exactly, each choice's log-likelihood and bits per byte to 4 decimals, a whole document's
log-likelihood (hundreds of float32 terms, which hf sums in float32) and perplexities to a relative 1e-6 / 1e-5,
on a server with `--numerics portable` (exact-parity scoring). A second server on the default flags (int8
activations) must score within the harness's stderr of it.

Window sizes: lm-eval's API models reserve one token of `max_length` for generation and another for the
rolling context (their rolling windows are max_length - 2 tokens), where `hf` uses max_length; so the API
side gets max_length 514 for hf's 512, making both send identical windows.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from steadyserve.testing.lm_eval_tasks import ROLLING, multiple_choice, write_task
from steadyserve.testing.server import ServerProcess
from steadyserve.testing.tiny_model import build_tiny_model

import lm_eval  # noqa: E402 - installed with the test extra; a missing harness fails here

WORDS = "fox dog cat sat ran the a on mat hat red blue green quick slow jumps over under".split()


def write_tasks(d: Path) -> None:
    rng = random.Random(0)

    def phrase(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(lo, hi)))

    rows = {"choice": [{"question": phrase(4, 8), "choices": [" " + phrase(1, 4) for _ in range(4)],
                        "answer": rng.randrange(4)} for _ in range(12)],
            "rolling": [{"text": phrase(20, 300)} for _ in range(6)],  # the longest need two windows
            "gen": [{"question": phrase(3, 7), "answer": rng.choice(WORDS)} for _ in range(6)]}
    for name, items in rows.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    write_task(d, "ss_choice", d / "choice.jsonl", multiple_choice("question"))
    write_task(d, "ss_rolling", d / "rolling.jsonl", ROLLING)
    write_task(d, "ss_gen", d / "gen.jsonl", (
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n"))


@pytest.fixture(scope="module")
def runs(models_dir: Path, tmp_path_factory) -> dict:
    from lm_eval.tasks import TaskManager

    model = build_tiny_model(models_dir / "tiny-1k-context", max_position_embeddings=1024)
    tasks = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(tasks)
    tm = TaskManager(include_path=str(tasks))

    def evaluate(kind: str, args: str, names: list[str], batch_size: int = 1, **kw) -> dict:
        return lm_eval.simple_evaluate(model=kind, model_args=args, tasks=names, task_manager=tm, log_samples=True,
                                       batch_size=batch_size, **kw)

    out: dict = {"model": str(model)}
    # The servers start in threads while transformers runs the same tasks in this one (the runs are independent):
    # the float32-activation path (--numerics portable, exact-parity scoring) and the default flags (int8).
    pool = ThreadPoolExecutor(2)
    starting = [pool.submit(ServerProcess, str(model), "--grpc-port", "-1", "--served-model-name", "tiny", *numerics)
                for numerics in (("--numerics", "portable"), ())]
    pool.shutdown(wait=False)
    try:
        hf = f"pretrained={model},dtype=float32,device=cpu,max_length=512"
        out["hf"] = evaluate("hf", hf, ["ss_choice", "ss_rolling"])
        out["hf_chat"] = evaluate("hf", hf, ["ss_gen"], apply_chat_template=True)
    except BaseException:
        for f in starting:
            if f.exception() is None:  # waits for the start; a failed start left nothing behind
                f.result().__exit__(None, None, None)
        raise
    api = "model=tiny,num_concurrent=1,max_retries=1,max_length=514"

    def completions(s: ServerProcess) -> dict:
        return evaluate("local-completions", f"base_url={s.http_url}/v1/completions,tokenizer={model},"
                        f"tokenizer_backend=huggingface,tokenized_requests=True,{api}",
                        ["ss_choice", "ss_rolling"], batch_size=8)  # 8 prompts per request

    with contextlib.ExitStack() as stack:
        errors = [f.exception() for f in starting]  # waits for both starts; each started one is stopped below
        s, default = [stack.enter_context(f.result()) if e is None else None for f, e in zip(starting, errors)]
        if s is None or default is None:
            raise next(e for e in errors if e is not None)
        out["ours"] = completions(s)
        out["ours_chat"] = evaluate("local-chat-completions", f"base_url={s.http_url}/v1/chat/completions,"
                                    f"tokenizer_backend=none,{api}", ["ss_gen"], apply_chat_template=True)
        out["default"] = completions(default)
    return out


def test_loglikelihood_multiple_choice_scores_equal_transformers(runs) -> None:
    ours, hf = runs["ours"]["results"]["ss_choice"], runs["hf"]["results"]["ss_choice"]
    assert ours["acc,none"] == hf["acc,none"] and ours["acc_norm,none"] == hf["acc_norm,none"]
    for a, b in zip(runs["ours"]["samples"]["ss_choice"], runs["hf"]["samples"]["ss_choice"], strict=True):
        assert [round(r[0][0], 4) for r in a["resps"]] == [round(r[0][0], 4) for r in b["resps"]]


def test_loglikelihood_rolling_scores_equal_transformers(runs) -> None:
    ours, hf = runs["ours"]["results"]["ss_rolling"], runs["hf"]["results"]["ss_rolling"]
    assert round(ours["bits_per_byte,none"], 4) == round(hf["bits_per_byte,none"], 4)
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        assert math.isclose(ours[metric], hf[metric], rel_tol=1e-5), (metric, ours[metric], hf[metric])
    docs = list(zip(runs["ours"]["samples"]["ss_rolling"], runs["hf"]["samples"]["ss_rolling"], strict=True))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runs["model"])
    assert any(len(tok(d["doc"]["text"])["input_ids"]) > 512 for d, _ in docs)  # some span two windows
    for a, b in docs:  # a document's log-likelihood sums hundreds of float32 values: hf sums them in float32
        assert a["resps"][0][0] == pytest.approx(b["resps"][0][0], rel=1e-6, abs=1e-4)


def test_the_default_paths_scores_stay_within_the_harness_stderr_of_float32(runs) -> None:
    """The default numerics (int8 activations) score within lm-eval's own stderr of the float32-activation path,
    and its bits per byte within 1% of it: its quantization moves no score beyond the harness's resolution."""
    ours, fp32 = runs["default"]["results"], runs["ours"]["results"]
    for metric in ("acc,none", "acc_norm,none"):
        stderr = fp32["ss_choice"][metric.replace(",", "_stderr,")]
        assert stderr > 0 and abs(ours["ss_choice"][metric] - fp32["ss_choice"][metric]) <= stderr, (metric, ours, fp32)
    a, b = ours["ss_rolling"]["bits_per_byte,none"], fp32["ss_rolling"]["bits_per_byte,none"]
    assert math.isclose(a, b, rel_tol=0.01), (a, b)
    # the two runs really are two paths: a choice's log-likelihood differs somewhere
    pairs = zip(runs["default"]["samples"]["ss_choice"], runs["ours"]["samples"]["ss_choice"], strict=True)
    assert any(r[0][0] != q[0][0] for x, y in pairs for r, q in zip(x["resps"], y["resps"]))


def test_chat_generation_equals_transformers(runs) -> None:
    ours, hf = runs["ours_chat"], runs["hf_chat"]
    assert ours["results"]["ss_gen"]["exact_match,none"] == hf["results"]["ss_gen"]["exact_match,none"]
    got = [s["resps"] for s in ours["samples"]["ss_gen"]]
    want = [s["resps"] for s in hf["samples"]["ss_gen"]]
    assert got == want and any(r[0][0] for r in got)  # the same greedy strings, not all empty
