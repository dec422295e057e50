"""Receipts (issue 42): asked for over every transport, made under concurrent load, replayed offline bit for bit.

The server is the tiny model's module server (conftest `server`); `steadyserve verify` loads the same model
directory offline. Every check here can fail: a tampered receipt must be caught and the difference named,
a receipt claiming a fingerprint this machine does not compute must be "not reproducible here", and a drawn
seed must be the seed the sampler ran with.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from http_util import stream_completion
from steadyserve.client import Client, generate_request
from steadyserve.numerics import describe
from steadyserve.receipts.format import parse
from steadyserve.receipts.replay import MISMATCH, NOT_REPRODUCIBLE, VERIFIED, verify

PROMPTS = ["The receipt proves", "Bits are bits, whatever", "A fleet of mixed CPUs", "one two three four"]


def http_receipts(url: str, i: int, header: bool = False) -> list[dict[str, Any]]:
    """Receipts of one HTTP request of kind i % 4: sampled n=2 unseeded, chat streamed greedy, scoring, seeded."""
    prompt = PROMPTS[i % len(PROMPTS)]
    kw: dict[str, Any] = {"headers": {"x-steadyserve-receipt": "1"}} if header else {}
    extra = {} if header else {"receipt": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        kind = i % 4
        if kind == 0:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "n": 2,
                                                "logprobs": 2, **extra}, **kw)
        elif kind == 1:
            _, chunks, done = stream_completion(c, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 5, "temperature": 0,
                "logprobs": True, "top_logprobs": 3, **extra}, **kw)
            assert done
            return [ch["choices"][0]["receipt"] for ch in chunks if ch["choices"] and "receipt" in ch["choices"][0]]
        elif kind == 2:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                                                **extra}, **kw)
        else:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 7, "temperature": 0.8, "top_k": 20,
                                                "seed": 1000 + i, "logprobs": 0, "stream": False, **extra}, **kw)
        assert r.status_code == 200, r.text
        return [ch["receipt"] for ch in r.json()["choices"]]


def ws_receipt(url: str, i: int, header: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 6, "temperature": 0.9,
                            "logprobs": 1}
    if not header:
        body["receipt"] = True
    headers = {"x-steadyserve-receipt": "true"} if header else {}
    with connect(url.replace("http", "ws") + "/v1/stream", additional_headers=headers, open_timeout=60) as ws:
        ws.send(json.dumps(body))
        while True:
            msg = json.loads(ws.recv(timeout=120))
            assert msg["type"] != "error", msg
            if msg["type"] == "final":
                return msg["receipt"]


def grpc_receipts(addr: str, i: int, metadata: bool = False) -> list[dict[str, Any]]:
    prompt = PROMPTS[i % len(PROMPTS)]
    with Client(addr, timeout=120) as c:
        if metadata:  # the field unset: the x-steadyserve-receipt metadata asks
            md = (("x-steadyserve-receipt", "1"),)
            msg = generate_request(prompt, max_tokens=5, temperature=0.7, logprobs=2)
            finals = [m.final for m in c.stub.Generate(msg, metadata=md, timeout=120) if m.HasField("final")]
            return [json.loads(finals[0].receipt)]
        score = c.score(prompt, top_logprobs=2, receipt=True)
        finals = [m.final for m in c.generate(prompt, max_tokens=6, temperature=1.0, logprobs=1, receipt=True)
                  if m.HasField("final")]
        return [json.loads(score.receipt), json.loads(finals[0].receipt)]


def background(url: str, i: int) -> None:
    """Requests without receipts, to vary the batches the receipts' requests share."""
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": "load " * (1 + i % 40), "max_tokens": 4 + i % 9,
                                            "temperature": 0.5, "ignore_eos": True})
        assert r.status_code == 200 and "receipt" not in r.json()["choices"][0]


@pytest.fixture(scope="module")
def receipts(server) -> list[dict[str, Any]]:
    """Receipts made under concurrent load over HTTP (field and header), WebSocket (field and header) and gRPC
    (field and metadata), interleaved with background traffic."""
    jobs = []
    for i in range(8):
        jobs += [("http", i, False), ("ws", i, False), ("grpc", i, False), ("bg", i, False), ("bg", i + 50, False)]
    jobs += [("http", 9, True), ("http", 10, True), ("ws", 11, True), ("grpc", 12, True)]

    def run(job: tuple[str, int, bool]) -> list[dict[str, Any]]:
        kind, i, alt = job
        if kind == "http":
            return http_receipts(server.http_url, i, alt)
        if kind == "ws":
            return [ws_receipt(server.http_url, i, alt)]
        if kind == "grpc":
            return grpc_receipts(server.grpc_addr, i, alt)
        background(server.http_url, i)
        return []

    with ThreadPoolExecutor(16) as pool:
        out = [r for rs in pool.map(run, jobs) for r in rs]
    return out


def test_receipts_from_every_transport_verify_offline(receipts, server, tiny_model, tmp_path) -> None:
    """`steadyserve verify` (the CLI, all receipts in one engine) verifies every receipt made under load."""
    assert len(receipts) == 38  # every request asked for one: 10 + 8 + 16 over the fields, 4 by header/metadata
    def kind(s: dict[str, Any]) -> str:
        if s["max_tokens"] == 0:
            return "score"
        return "greedy" if s["temperature"] == 0 else "drawn seed" if s["seed_drawn"] else "seeded"

    assert {kind(r["sampling"]) for r in receipts} == {"score", "greedy", "drawn seed", "seeded"}
    fingerprint = httpx.get(server.http_url + "/v1/models").json()["data"][0]["system_fingerprint"]
    assert {r["model"]["fingerprint"] for r in receipts} == {fingerprint}
    assert all("text" not in json.dumps(r["sampling"]) for r in receipts)
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(receipts))
    p = subprocess.run([sys.executable, "-m", "steadyserve.cli", "verify", str(path), "--model", tiny_model, "--json"],
                       capture_output=True, text=True, timeout=600)
    report = json.loads(p.stdout)
    bad = [v for v in report["receipts"] if v["status"] != VERIFIED]
    assert not bad, bad[:3]
    assert p.returncode == 0 and report["summary"]["verified"] == len(receipts)


def test_batched_and_alone_replays_agree(receipts, tiny_model) -> None:
    """The verdicts do not depend on how the receipts are batched: all at once, or one at a time."""
    some = [(f"r{i}", parse(r)) for i, r in enumerate(receipts[:10])]
    # A generated token to change: the receipt with the most of them (an unseeded sample may stop at its first
    # token on the tiny model's end-of-text, so receipts[0] alone was not always long enough: a 1-in-~100 failure).
    bad = copy.deepcopy(max(receipts, key=lambda r: len(r["output_token_ids"])))
    assert len(bad["output_token_ids"]) >= 2, "every request stopped at its first token"
    bad["output_token_ids"][1] ^= 1
    some.append(("bad", parse(bad)))
    together = verify(some, model=tiny_model)
    alone = verify(some, model=tiny_model, batched=False)
    assert [(v.status, v.detail) for v in together] == [(v.status, v.detail) for v in alone]
    assert [v.status for v in together] == [VERIFIED] * 10 + [MISMATCH]


def _flip_bit(r: dict[str, Any], index: int, bit: int, rehash: bool) -> dict[str, Any]:
    r = copy.deepcopy(r)
    data = bytearray(base64.b64decode(r["logprobs"]["float32"]))
    data[4 * index + bit // 8] ^= 1 << (bit % 8)
    r["logprobs"]["float32"] = base64.b64encode(bytes(data)).decode()
    if rehash:  # a forger who also fixes the hash
        r["logprobs"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    return r


def test_tampered_receipts_are_caught_and_named(receipts, tiny_model) -> None:
    """One flipped bit in a logprob, one changed token, a changed sampling parameter: each is a mismatch that
    names what differs, with both values; the untouched receipt verifies in the same batch."""
    sampled = next(r for r in receipts if r["sampling"]["seed_drawn"] and r["logprobs"]["count"] >= 6
                   and len(r["output_token_ids"]) >= 4)
    cases = {
        "original": sampled,
        "bit": _flip_bit(sampled, 4, 0, rehash=True),  # the lowest mantissa bit of the 5th value
        "bit_no_rehash": _flip_bit(sampled, 0, 30, rehash=False),
        "token": copy.deepcopy(sampled),
        "seed": copy.deepcopy(sampled),
        "temperature": copy.deepcopy(sampled),
        "max_tokens": copy.deepcopy(sampled),
    }
    cases["token"]["output_token_ids"][2] += 1
    cases["seed"]["sampling"]["seed"] += 1
    cases["temperature"]["sampling"]["temperature"] = 0.0  # greedy instead of the sampled run
    cases["max_tokens"]["sampling"]["max_tokens"] -= 1
    verdicts = dict(zip(cases, verify([(k, parse(v)) for k, v in cases.items()], model=tiny_model)))
    assert verdicts["original"].status == VERIFIED
    for k in cases:
        if k != "original":
            assert verdicts[k].status == MISMATCH, (k, verdicts[k])

    bit = verdicts["bit"]
    assert bit.first_token is None and bit.first_logprob is not None
    lp = bit.first_logprob
    assert lp["index"] == 4 and "output token" in lp["where"] and lp["receipt"] != lp["replay"]
    assert int(lp["receipt_bits"], 16) ^ int(lp["replay_bits"], 16) == 1 << 24  # bit 0 of the LE bytes, read BE
    assert not bit.problems  # the forger fixed the hash: only the replay catches it
    nohash = verdicts["bit_no_rehash"]
    assert nohash.first_logprob["index"] == 0 and any("altered" in p for p in nohash.problems)

    tok = verdicts["token"].first_token
    assert tok == {"index": 2, "receipt": sampled["output_token_ids"][2] + 1, "replay": sampled["output_token_ids"][2]}
    assert "output token 2" in verdicts["token"].detail
    for k in ("seed", "temperature"):  # another sampling run: tokens differ, and so do the logprobs after them
        assert verdicts[k].first_token is not None, k
    mt = verdicts["max_tokens"]
    assert mt.first_token["index"] == len(sampled["output_token_ids"]) - 1 and mt.first_token["replay"] is None


def test_other_fingerprints_are_not_reproducible_here(receipts, tiny_model) -> None:
    """A receipt from another numerics path (a --numerics host id of another machine), a CUDA device, other
    weights or without batch invariance is 'not reproducible here', never a mismatch; the CLI exits 3."""
    base = receipts[0]
    claims = {}
    host = copy.deepcopy(base)
    host["model"]["numerics"] = {"mode": "host", "id": "h000000"}
    claims["host"] = host
    cuda = copy.deepcopy(base)
    cuda["model"]["device"] = "cuda:0"
    claims["cuda"] = cuda
    weights = copy.deepcopy(base)
    weights["model"]["weights_sha256"] = "0" * 64
    claims["weights"] = weights
    nbi = copy.deepcopy(base)
    nbi["model"]["batch_invariant"] = False
    claims["nbi"] = nbi
    kernels = copy.deepcopy(base)
    kernels["model"]["numerics"]["id"] = "p000000"
    claims["kernels"] = kernels
    verdicts = dict(zip(claims, verify([(k, parse(v)) for k, v in claims.items()], model=tiny_model)))
    for k, v in verdicts.items():
        assert v.status == NOT_REPRODUCIBLE, (k, v)
    assert "h000000" in verdicts["host"].detail and "cuda" in verdicts["cuda"].detail
    assert "weights" in verdicts["weights"].detail and "nbi" in verdicts["nbi"].detail


def test_cli_exit_status_and_report(receipts, tiny_model, tmp_path) -> None:
    """Exit 1 with a mismatch among verified receipts; 3 when the rest is only not reproducible; names both."""
    host = copy.deepcopy(receipts[1])
    host["model"]["numerics"] = {"mode": "host", "id": "h000000"}
    bad = _flip_bit(receipts[0], 0, 3, rehash=True) if receipts[0]["logprobs"]["count"] else None
    (tmp_path / "nr.json").write_text(json.dumps([receipts[2], host]))
    p = subprocess.run([sys.executable, "-m", "steadyserve.cli", "verify", str(tmp_path / "nr.json"), "--model",
                        tiny_model], capture_output=True, text=True, timeout=600)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "NOT REPRODUCIBLE HERE" in p.stdout and "VERIFIED" in p.stdout
    if bad is not None:
        (tmp_path / "bad.json").write_text(json.dumps({"receipts": [receipts[2], bad, host]}))
        p = subprocess.run([sys.executable, "-m", "steadyserve.cli", "verify", str(tmp_path / "bad.json"),
                            "--model", tiny_model], capture_output=True, text=True, timeout=600)
        assert p.returncode == 1 and "MISMATCH" in p.stdout and "float32 bits" in p.stdout, p.stdout


def test_drawn_seed_is_the_seed_sampled_with(server) -> None:
    """An unseeded sampled request's receipt names a drawn seed; the same request sent with that seed gives the
    same tokens and logprob bits (the seed is the one the sampler ran with), and asking for a receipt changes
    no bit of a seeded request."""
    body = {"prompt": "drawn seeds replay", "max_tokens": 8, "temperature": 1.0, "logprobs": 1}
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        first = c.post("/v1/completions", json={**body, "receipt": True}).json()["choices"][0]
        rec = first["receipt"]
        assert rec["sampling"]["seed_drawn"] and isinstance(rec["sampling"]["seed"], int)
        again = c.post("/v1/completions", json={**body, "seed": rec["sampling"]["seed"]}).json()["choices"][0]
        assert again["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"]
        assert again["text"] == first["text"] and "receipt" not in again
        seeded = {**body, "seed": 12345}
        plain = c.post("/v1/completions", json=seeded).json()["choices"][0]
        with_receipt = c.post("/v1/completions", json={**seeded, "receipt": True}).json()["choices"][0]
        assert plain["logprobs"] == with_receipt["logprobs"] and plain["text"] == with_receipt["text"]
        lps = with_receipt["logprobs"]["token_logprobs"]
        assert with_receipt["receipt"]["sampling"]["seed"] == 12345
        data = base64.b64decode(with_receipt["receipt"]["logprobs"]["float32"])
        values = struct.unpack(f"<{len(data) // 4}f", data)
        assert [values[2 * k] for k in range(len(lps))] == lps  # logprob then 1 alternative, per token
        # A bad value for the field is refused by name, like any field.
        r = c.post("/v1/completions", json={**body, "receipt": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "receipt"


def _greedy_receipts_under_load(srv, n: int = 12) -> list[dict[str, Any]]:
    def one(i: int) -> dict[str, Any]:
        with httpx.Client(base_url=srv.http_url, timeout=120) as c:
            r = c.post("/v1/completions", json={"prompt": PROMPTS[i % 4] + " x" * (i % 5), "max_tokens": 6,
                                                "temperature": 0, "logprobs": 1, "receipt": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["receipt"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_verify_catches_a_server_that_breaks_batch_invariance(sw_invariant, sw_drift, smolwidth_model) -> None:
    """Receipts from the TEST-ONLY drifting server (it claims -bi; its logprobs shift with the step's size) do not
    verify: the first differing logprob is named while the tokens agree (a uniform shift keeps the argmax).
    The same requests to the invariant server verify."""
    good = _greedy_receipts_under_load(sw_invariant)
    drifted = _greedy_receipts_under_load(sw_drift)
    verdicts = verify([(f"good{i}", parse(r)) for i, r in enumerate(good)]
                      + [(f"drift{i}", parse(r)) for i, r in enumerate(drifted)], model=smolwidth_model)
    assert [v.status for v in verdicts[:len(good)]] == [VERIFIED] * len(good)
    caught = verdicts[len(good):]
    assert all(v.status == MISMATCH and v.first_token is None and v.first_logprob is not None for v in caught)
    # The fleet check names the drifting replica too: validate --receipts fails against it.
    rc, rep = _validate(sw_drift, smolwidth_model)
    assert rc == 1 and not rep["passed"] and rep["receipts"]["mismatch"] == 6, rep["receipts"]


def _validate(srv, model: str, extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    p = subprocess.run([sys.executable, "-m", "steadyserve.cli", "validate", "--http", srv.http_url, "--grpc",
                        srv.grpc_addr, "-n", "6", "-c", "8", "--receipts", "6", "--max-tokens", "5", "--model", model,
                        "--json", *extra], capture_output=True, text=True, timeout=900)
    return p.returncode, json.loads(p.stdout)


def test_validate_collects_receipts_under_load_and_verifies_them(server, tiny_model) -> None:
    """`steadyserve validate --receipts N`: N receipts (scoring, greedy, unseeded sampling over HTTP and gRPC)
    collected under background load, all verified on this machine."""
    rc, rep = _validate(server, tiny_model)
    assert rc == 0 and rep["passed"], json.dumps(rep)  # whole: pytest would shorten a dict to its first keys
    assert rep["receipts"]["receipts"] == 6 and rep["receipts"]["verified"] == 6 and rep["background"] > 0


def test_a_host_numerics_receipt_replays_on_its_own_path(tiny_model) -> None:
    """A receipt made on `--numerics host` names its host id: this machine computes that id, so verify replays it
    on the host path (not the default portable one) and it verifies; the same receipt with the portable id
    would need other bits and is caught."""
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models.loader import Fingerprint, load_model
    from steadyserve.receipts.format import identity_of, make_receipt

    loaded = load_model(tiny_model, numerics="host")
    assert loaded.numerics is not None and loaded.numerics.mode == "host"
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=16 * 1024**2, threads=2, numerics="host"))
    fp = Fingerprint(loaded.weights_hash[:12], "float32", "cpu", True, loaded.model.kernel_id,
                     loaded.numerics.numerics_id)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=2)
    ids = list(loaded.tokenizer("host numerics")["input_ids"])
    out = run_requests(engine, [Request("h", ids, params)])["h"]
    receipt = make_receipt(identity_of(loaded, fp), "h", 0, ids, params, 5, out.token_ids, out.finish_reason,
                           out.prompt_logprobs, out.logprobs)
    assert receipt["model"]["numerics"]["id"].startswith("h")
    as_portable = copy.deepcopy(receipt)
    portable_id = describe("portable", "", "", (), "", "", "", "").numerics_id  # names no machine fact
    as_portable["model"]["numerics"] = {"mode": "portable", "id": portable_id}
    as_portable["model"]["weights_sha256"] = receipt["model"]["weights_sha256"]
    v = verify([("host", parse(receipt)), ("portable", parse(as_portable))], model=tiny_model)
    assert v[0].status == VERIFIED and v[0].numerics.startswith("host"), v[0]
    assert v[1].status != VERIFIED, v[1]


def test_grammar_constrained_receipts_check_their_logprobs_by_scoring(server, tiny_model) -> None:
    """A receipt of structured output (response_format) or tool calls names its grammar by hash only: verify
    scores the output after the prompt and checks every logprob bit (a flipped one is caught); without logprobs
    there is nothing to check and it is not reproducible here."""
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    base = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 12, "receipt": True}
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        bodies = [{**base, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
                   "logprobs": True, "top_logprobs": 2, "temperature": 0.9},
                  {**base, "tools": tools, "tool_choice": "required", "logprobs": True, "temperature": 0},
                  {**base, "response_format": {"type": "json_object"}, "temperature": 0}]
        recs = []
        for b in bodies:
            r = c.post("/v1/chat/completions", json=b)
            assert r.status_code == 200, r.text
            recs.append(r.json()["choices"][0]["receipt"])
    assert all(r["grammar_sha256"] for r in recs) and recs[0]["grammar_sha256"] != recs[1]["grammar_sha256"]
    flipped = _flip_bit(recs[0], len(recs[0]["output_token_ids"]), 1, rehash=True)
    v = verify([(str(i), parse(r)) for i, r in enumerate([*recs, flipped])], model=tiny_model)
    assert [x.status for x in v] == [VERIFIED, VERIFIED, NOT_REPRODUCIBLE, MISMATCH], v
    assert "scoring the output" in v[0].detail and "no logprobs" in v[2].detail
    assert v[3].first_logprob["index"] == len(recs[0]["output_token_ids"]) and v[3].first_token is None
