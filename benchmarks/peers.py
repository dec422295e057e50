"""Starting, probing and stopping the servers benchmarks/serving.py measures steadyserve against.

- the lock baseline (benchmarks/baseline_server.py): transformers generate() behind one lock;
- `transformers serve --continuous-batching`: Hugging Face's own OpenAI-compatible server, installed
  with the `bench` extra (`.venv/bin/pip install -e '.[bench]'`).

Each peer runs in its own process on 127.0.0.1, float32 on the CPU with the same thread count as
steadyserve; `peak_rss_mib` reads VmHWM of the server process and of every process below it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
INSTALL_BENCH = ".venv/bin/pip install -e '.[bench]'"
# transformers serve's /v1/completions refuses unknown fields (HTTP 422 for `ignore_eos`) but takes a
# `generation_config` JSON string; an EOS id of -1 never matches, so every stream runs to max_tokens
# (the continuous-batching scheduler's own sentinel for "no EOS").
TRANSFORMERS_NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}


class PeerMissing(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def peak_rss_mib(pid: int) -> dict:
    """VmHWM (peak resident set) of a process and its descendants, read while they still run. With
    children, the sum bounds their combined peak from above (their peaks may not coincide)."""
    per = {}
    for p in _descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    per[p] = int(line.split()[1]) / 1024
        except OSError:
            continue
    return {"peak_rss_mib": round(sum(per.values()), 1), "processes": len(per)}


class Peer:
    """A server process we started; `stop()` ends it (and waits), `peak_rss()` reads it before that."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], health: str, settings: dict,
                 startup_timeout: float = 300.0) -> None:
        self.name, self.settings = name, {**settings, "command": " ".join(argv)}
        self.url = f"http://127.0.0.1:{settings['port']}"  # before the process starts: nothing left running
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-{name.split()[0]}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.url + health, timeout=1)
                return
            except OSError:
                time.sleep(0.25)
        tail = self.log_tail()  # stop() removes the log
        self.stop()
        raise RuntimeError(f"{name} did not answer {health} in {startup_timeout:.0f} s:\n{tail}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def peak_rss(self) -> dict:
        return peak_rss_mib(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            try:  # its own session: anything it forked and left behind
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def start_baseline(model_dir: str, threads: int) -> Peer:
    port = free_port()
    return Peer("baseline", [sys.executable, str(HERE / "baseline_server.py"), "--model", model_dir, "--port",
                             str(port), "--threads", str(threads)], thread_env(threads), "/docs",
                {"port": port, "dtype": "float32", "threads": threads})


def check_transformers_serve() -> None:
    """Raise PeerMissing, naming the install command, when `transformers serve` cannot run here."""
    try:
        from transformers.utils.import_utils import is_serve_available
    except ImportError as e:
        raise PeerMissing(f"transformers is not importable ({e}); install the benchmark extra: {INSTALL_BENCH}")
    missing = [m for m in ("fastapi", "uvicorn", "openai", "pydantic", "rich") if not _importable(m)]
    if missing or not is_serve_available():
        raise PeerMissing(f"`transformers serve` needs {', '.join(missing) or 'transformers[serving]'}; "
                          f"install the benchmark extra: {INSTALL_BENCH}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def kv_blocks(model_dir: str, kv_bytes: int, page_size: int = 256) -> int:
    """The number of continuous-batching cache blocks (page_size tokens of K and V for every layer)
    that fit in kv_bytes, so the peer's KV cache matches steadyserve's --kv-cache-memory."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_block = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4
    return max(1, kv_bytes // (per_block * page_size))


def start_transformers_serve(model_dir: str, threads: int, kv_bytes: int) -> Peer:
    """`transformers serve --continuous-batching` pinned to the local converted model directory (no
    Hub access: HF_HUB_OFFLINE=1), float32 on the CPU, `threads` OpenMP/MKL threads, and a KV cache of
    kv_bytes (by default it takes 90% of free memory on a CPU); other scheduler settings are its defaults."""
    check_transformers_serve()
    import transformers

    port = free_port()
    blocks = kv_blocks(model_dir, kv_bytes)
    argv = [str(Path(sys.executable).parent / "transformers"), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--dtype", "float32", "--cb-num-blocks", str(blocks), "--log-level", "warning", model_dir]
    env = {**thread_env(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return Peer("transformers serve", argv, env, "/health",
                {"port": port, "dtype": "float32", "device": "cpu", "threads": threads, "env": env,
                 "cb_num_blocks": blocks, "cb_page_size": 256, "kv_cache_bytes": kv_bytes,
                 "cb_max_batch_tokens": "default (8192)", "attn_implementation": "default", "compile": False,
                 "transformers": transformers.__version__, "request_extra_body": TRANSFORMERS_NO_EOS})


def supports_echo_logprobs(url: str) -> tuple[bool, str]:
    """Whether /v1/completions returns prompt logprobs for echo=true (what scoring and validate need)."""
    body = json.dumps({"prompt": "the model server", "max_tokens": 1, "echo": True, "logprobs": 0,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        return False, f"echo+logprobs request failed: {e}"
    lp = choice.get("logprobs") or {}
    if not lp.get("token_logprobs"):
        return False, "/v1/completions ignores echo and logprobs (returns no token_logprobs)"
    return True, ""


def warm_up(url: str, extra_body: dict | None = None) -> None:
    """Two short streamed requests, so lazy start-up work (the peer builds its paged cache on the first
    request) is not counted in the first measured TTFT."""
    for words in (3, 30):
        body = {"prompt": " ".join(["the model server"] * words), "max_tokens": 4, "stream": True,
                "temperature": 0.0, **(extra_body or {})}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()


def amd_generation(family: int, model: int) -> str:
    """An AMD EPYC's Zen generation from CPUID's family and model ("" where unknown): the model name says only
    "AMD EPYC" on these machines, and Zen 1 (AVX2 only), Zen 4 and Zen 5 differ in what the kernels can use."""
    if family == 23:
        return "Zen 1" if model < 0x30 else "Zen 2"
    if family == 25:
        return "Zen 3" if model < 0x10 or 0x20 <= model < 0x60 else "Zen 4"
    if family == 26:
        return "Zen 5"
    return ""


def cpu_name() -> str:
    """/proc/cpuinfo's model name; an AMD EPYC's with its Zen generation added (benchmarks/report_runs.py groups
    results by it)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        name = fields.get("model name", "")
        if "EPYC" in name and "Zen" not in name and fields.get("cpu family", "").isdigit():
            gen = amd_generation(int(fields["cpu family"]), int(fields.get("model", "0")))
            name = f"{name} {gen}" if gen else name
        if name:
            return name
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
