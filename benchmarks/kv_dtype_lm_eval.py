"""lm-eval scores per KV cache format: is each within the float32 cache's stderr? (issue 44, "lm-eval within
stderr of the fp32 cache"); with --numerics, per numerics path too (issue 39: int8 activations within the
float32 path's stderr)

The real lm-evaluation-harness (`local-completions`, token-id prompts, as docs/quickstart.md drives it) against a
live steadyserve server per --kv-cache-dtype (fp32, f16, bf16, q8_0; one server at a time, same model, same
flags otherwise). The machine has no Hugging Face hub access, so the tasks are built here from real English
prose found offline: the docstrings of Python's standard library modules (inspect.getdoc over a fixed module
list; lines that look like code are dropped), in a fixed order with a fixed seed:
- kv_lastword: LAMBADA-style. A sentence without its last word; the choices are the true last word and three
  other words of the same sentence (other sentences' last words where it has too few) (multiple_choice: acc and acc_norm with their stderr);
- kv_rolling: rolling perplexity (loglikelihood_rolling: word_perplexity, byte_perplexity, bits_per_byte)
  over a few long documents, each the concatenated docstrings of some modules. lm-eval gives these no stderr,
  so the script adds one for bits_per_byte: the standard error of the per-document bits per byte.

Writes benchmarks/results/kv_dtype_lm_eval.json (per model and format: the metrics, their stderr, the
difference to fp32 and whether it is within fp32's stderr) and prints a table.

    .venv/bin/python benchmarks/kv_dtype_lm_eval.py [--models smollm2,gemma3-270m] [--items 300] [--docs 6]
        [--doc-words 1500] [--formats fp32,f16,bf16,q8_0] [--numerics portable,int8]
    # a quick check: --items 20 --docs 1 --doc-words 200 --formats fp32,q8_0
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import math
import random
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

from peers import cpu_name

from steadyserve.models import known
from steadyserve.models.loader import convert_gguf
from steadyserve.testing.lm_eval_tasks import ROLLING, multiple_choice, write_task
from steadyserve.testing.server import ServerProcess

HERE = Path(__file__).parent
FORMATS = ("fp32", "f16", "bf16", "q8_0")
# Standard-library modules with long English docstrings; a fixed list so the text is the same on every run of
# the same Python version.
MODULES = ("abc argparse asyncio base64 bisect calendar collections concurrent.futures contextlib copy csv "
           "dataclasses datetime decimal difflib email enum fractions functools gettext glob gzip hashlib heapq "
           "hmac html http.client http.server imaplib inspect io ipaddress itertools json logging mailbox "
           "multiprocessing numbers operator optparse os pathlib pickle pkgutil platform poplib pprint queue "
           "random re sched secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 "
           "ssl statistics string struct subprocess tarfile tempfile textwrap threading timeit tkinter "
           "tokenize traceback types typing unittest urllib.parse urllib.request uuid warnings weakref "
           "xml.dom.minidom xml.etree.ElementTree zipfile zlib").split()
PROSE_LINE = re.compile(r"^[A-Z][A-Za-z ,;:'()\-]+[.!?]?$")


def module_prose(name: str) -> str:
    """The English prose of a module's docstrings (the module's and its public members'), code lines dropped."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module this Python lacks (tkinter without Tk) is skipped
        return ""
    docs = [inspect.getdoc(mod) or ""]
    for attr in sorted(dir(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr, None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
            docs.append(inspect.getdoc(obj) or "")
    paragraphs = []
    for doc in docs:
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(line.strip() for line in para.splitlines())
            # prose: mostly letters, no code markers (>>>, =, brackets of calls, paths)
            if len(text.split()) >= 8 and not re.search(r">>>|[=\[\]{}<>|\\/_`*#@$]|\w\(", text):
                paragraphs.append(text)
    return "\n\n".join(paragraphs)


def sentences(text: str) -> list[str]:
    out = []
    for s in re.split(r"(?<=[.!?])\s+", text):
        words = s.split()
        if 10 <= len(words) <= 40 and s.endswith(".") and re.fullmatch(r"[a-z]{3,}", words[-1].rstrip(".")):
            out.append(s[:-1])  # the sentence without its full stop: the last word is the target
    return out


def write_tasks(d: Path, items: int, docs: int, doc_words: int, seed: int = 0) -> dict:
    """The two tasks' YAML and jsonl in `d`; returns a description of what was built."""
    prose = {m: module_prose(m) for m in MODULES}
    prose = {m: t for m, t in prose.items() if t}
    rng = random.Random(seed)
    sents = sorted({s for t in prose.values() for s in sentences(t)})
    picked = rng.sample(sents, min(items, len(sents)))
    last_words = sorted({s.split()[-1] for s in sents})
    rows = []
    for s in picked:
        *ctx, target = s.split()
        # Distractors from the sentence's own words where it has three (on topic, so the task is not trivial),
        # else from other sentences' last words.
        own = sorted({w for w in ctx if re.fullmatch(r"[a-z]{3,}", w) and w != target})
        pool = own if len(own) >= 3 else [w for w in last_words if w != target]
        distractors = rng.sample(pool, 3)
        choices = distractors + [target]
        rng.shuffle(choices)
        rows.append({"context": " ".join(ctx), "choices": [" " + c for c in choices], "answer": choices.index(target)})
    # Rolling documents: whole modules' prose in order, cut at doc_words words.
    documents, cur = [], []
    for m in sorted(prose):
        cur += prose[m].split(" ")
        if len(cur) >= doc_words:
            documents.append(" ".join(cur[:doc_words]))
            cur = []
        if len(documents) == docs:
            break
    (d / "lastword.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "rolling.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    write_task(d, "kv_lastword", d / "lastword.jsonl", multiple_choice("context", target_delimiter=""))
    write_task(d, "kv_rolling", d / "rolling.jsonl", ROLLING)
    return {"source": f"docstrings of {len(prose)} Python {sys.version.split()[0]} standard-library modules "
                      "(inspect.getdoc, code lines dropped)",
            "lastword_items": len(rows), "lastword_pool_sentences": len(sents), "rolling_docs": len(documents),
            "rolling_words_per_doc": doc_words, "seed": seed}


def doc_bpb_stderr(samples: list[dict]) -> float:
    """Standard error of the mean of per-document bits per byte (lm-eval gives perplexities no stderr)."""
    bpb = [-s["resps"][0][0] / len(s["doc"]["text"].encode()) / math.log(2) for s in samples]
    if len(bpb) < 2:
        return float("nan")
    mean = sum(bpb) / len(bpb)
    return math.sqrt(sum((b - mean) ** 2 for b in bpb) / (len(bpb) - 1) / len(bpb))


def evaluate(model: str, fmt: str, tokenizer: str, tm, max_length: int, threads: int,
             numerics: str = "portable") -> dict:
    import lm_eval

    t0 = time.monotonic()
    with ServerProcess(model, "--kv-cache-dtype", fmt, "--numerics", numerics, "--grpc-port", "-1",
                       "--served-model-name", "m",
                       "--kv-cache-memory", "512MiB", threads=threads,
                       startup_timeout=1200) as s:
        args = (f"base_url={s.http_url}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface,"
                f"tokenized_requests=True,model=m,num_concurrent=1,max_retries=1,max_length={max_length}")
        r = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["kv_lastword", "kv_rolling"],
                                    task_manager=tm, log_samples=True, batch_size=8, bootstrap_iters=1000)
    res = r["results"]
    lw, ro = res["kv_lastword"], res["kv_rolling"]
    return {"acc": lw["acc,none"], "acc_stderr": lw["acc_stderr,none"], "acc_norm": lw["acc_norm,none"],
            "acc_norm_stderr": lw["acc_norm_stderr,none"], "word_perplexity": ro["word_perplexity,none"],
            "byte_perplexity": ro["byte_perplexity,none"], "bits_per_byte": ro["bits_per_byte,none"],
            "bits_per_byte_stderr": doc_bpb_stderr(r["samples"]["kv_rolling"]),
            "doc_loglikelihoods": [s["resps"][0][0] for s in r["samples"]["kv_rolling"]],
            "seconds": round(time.monotonic() - t0, 1)}


def compare(row: dict, ref: dict) -> dict:
    out = {}
    for m, se in (("acc", "acc_stderr"), ("acc_norm", "acc_norm_stderr"), ("bits_per_byte", "bits_per_byte_stderr")):
        diff = row[m] - ref[m]
        out[m] = {"diff_to_fp32": diff, "fp32_stderr": ref[se], "within_fp32_stderr": abs(diff) <= ref[se]}
    out["word_perplexity"] = {"rel_diff_to_fp32": row["word_perplexity"] / ref["word_perplexity"] - 1}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2", help="packaged model names, comma-separated (smollm2, gemma3-270m)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--items", type=int, default=300, help="last-word items")
    p.add_argument("--docs", type=int, default=6, help="rolling-perplexity documents")
    p.add_argument("--doc-words", type=int, default=1500, help="words per rolling document")
    p.add_argument("--max-length", type=int, default=2050, help="lm-eval max_length (windows of max_length-2)")
    p.add_argument("--numerics", default="portable",
                   help="numerics paths, comma-separated (portable, int8): each runs every format; the reference is "
                        "portable with the fp32 cache, so list portable first with fp32 among the formats")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=str(HERE / "results" / "kv_dtype_lm_eval.json"))
    a = p.parse_args()
    from lm_eval.tasks import TaskManager

    tasks = Path(tempfile.mkdtemp(prefix="kv_dtype_lm_eval_tasks-"))  # regenerated each run: same seed, same text
    built = write_tasks(tasks, a.items, a.docs, a.doc_words)
    tm = TaskManager(include_path=str(tasks))
    formats = a.formats.split(",")
    out: dict = {"benchmark": "kv_dtype_lm_eval", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "cpu": cpu_name(), "command": "python " + " ".join(sys.argv), "tasks": built,
                 "harness": f"lm-eval {importlib.metadata.version('lm_eval')} local-completions, "
                            f"tokenized_requests, batch_size 8, max_length {a.max_length}", "models": {}}
    for name in a.models.split(","):
        gguf = known.resolve(name)
        tokenizer = str(convert_gguf(Path(gguf), with_weights=False)[0])
        rows: dict = {}
        for numerics in a.numerics.split(","):
            for fmt in formats:
                key = fmt if numerics == "portable" else f"{fmt} --numerics {numerics}"
                rows[key] = evaluate(str(gguf), fmt, tokenizer, tm, a.max_length, a.threads, numerics)
                print(name, key, {k: v for k, v in rows[key].items() if k != "doc_loglikelihoods"}, flush=True)
                if "fp32" in rows:
                    rows[key]["vs_fp32"] = compare(rows[key], rows["fp32"])
                out["models"][name] = {"gguf": Path(gguf).name, "formats": rows}
                Path(a.output).write_text(json.dumps(out, indent=1) + "\n")  # after each run: a partial run keeps it
    print(f"\n| model | KV (numerics) | acc (± se) | Δacc | acc_norm (± se) | bits/byte (± se) | Δbpb | word ppl | within fp32 se |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in out["models"].items():
        for fmt, r in m["formats"].items():
            v = r.get("vs_fp32", {})
            ok = "yes" if v and all(v[k]["within_fp32_stderr"] for k in ("acc", "acc_norm", "bits_per_byte")) else "no"
            print(f"| {name} | {fmt} | {r['acc']:.4f} ± {r['acc_stderr']:.4f} | {v.get('acc', {}).get('diff_to_fp32', 0):+.4f} "
                  f"| {r['acc_norm']:.4f} ± {r['acc_norm_stderr']:.4f} | {r['bits_per_byte']:.5f} ± "
                  f"{r['bits_per_byte_stderr']:.5f} | {v.get('bits_per_byte', {}).get('diff_to_fp32', 0):+.6f} | "
                  f"{r['word_perplexity']:.4f} | {ok if v else '-'} |")


if __name__ == "__main__":
    main()
