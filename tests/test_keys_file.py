"""The keys file (--api-keys, steadyserve/tenants.py) and each tenant's own limits (api/quotas.py), without a
server: what a file may say and how a bad one is refused (naming the file and the field), the hash-key
command, and the token buckets and seats on a fake clock. The same, against a real server: test_tenants.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from steadyserve.api.quotas import Load, TenantQuotas
from steadyserve.cli import build_parser, config_from_args
from steadyserve.config import ConfigError
from steadyserve.limits import Refused
from steadyserve.tenants import KeysFileError, Tenant, hash_key, load_keys_file, single_key

DIGEST = hash_key("k1")


def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


def test_a_keys_file_resolves_each_key_to_its_tenant(tmp_path) -> None:
    path = write(tmp_path, f'''
[[tenant]]
name = "chat"
keys = ["{DIGEST}", "sha256:{hash_key('k2').upper()}"]
weight = 3
max_concurrent = 8
prompt_tokens_per_minute = 1000
priority = "interactive"
roles = ["admin"]

[[tenant]]
name = "evals"
keys = ["{hash_key('k3')}"]
priority = "batch"
endpoints = ["score"]
''')
    ring = load_keys_file(path)
    chat, evals = ring.tenants["chat"], ring.tenants["evals"]
    assert ring.resolve("k1") is chat and ring.resolve("k2") is chat and ring.resolve("k3") is evals
    assert ring.resolve("k4") is None and ring.resolve("") is None
    assert (chat.weight, chat.max_concurrent, chat.prompt_tokens_per_minute, chat.output_tokens_per_minute) == \
        (3.0, 8, 1000, None)
    assert chat.may("chat") and chat.may("metrics") and chat.may(None)
    assert evals.priority == "batch" and evals.may("score") and not evals.may("chat")
    assert not evals.may("console") and not evals.may("metrics")
    assert single_key("k").resolve("k").may("console")  # --api-key: one admin tenant


@pytest.mark.parametrize("body, field", [
    ("", "no tenants"),
    ("[[tenant]]\nname = 'a'\nkeys = ['k1']\n", "keys[0] is not a sha256 hex digest"),
    (f"[[tenant]]\nname = 'a b'\nkeys = ['{DIGEST}']\n", "tenant[0]: name must be"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\nweight = 0\n", "tenant[0] (a): weight"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\nmax_concurent = 3\n", "unknown field 'max_concurent'"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\nmax_concurrent = 0\n", "max_concurrent must be"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\npriority = 'urgent'\n", "priority must be one of"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\nendpoints = ['chat', 'admin']\n", "endpoints: unknown name"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\nroles = ['root']\n", "roles: unknown name 'root'"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\n[[tenant]]\nname = 'a'\nkeys = ['{hash_key('x')}']\n",
     "name 'a' is used twice"),
    (f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\n[[tenant]]\nname = 'b'\nkeys = ['{DIGEST}']\n",
     "tenant[1] (b): keys[0] is also a key of tenant 'a'"),
    ("[[tenant]\n", "not valid TOML"),
    (f"tenants = 1\n[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\n", "unknown top-level field 'tenants'"),
])
def test_a_bad_keys_file_is_refused_naming_the_file_and_field(tmp_path, body: str, field: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(KeysFileError) as e:
        load_keys_file(path)
    assert str(e.value).startswith(f"--api-keys {path}: ") and field in str(e.value), str(e.value)
    assert "k1" not in str(e.value).replace(DIGEST, "")  # a key in clear would never be echoed


def test_serve_with_a_bad_keys_file_exits_at_once_with_the_file_and_field(tmp_path, tiny_model: str) -> None:
    path = write(tmp_path, f"[[tenant]]\nname = 'a'\nkeys = ['{DIGEST}']\nweight = -1\n")
    r = subprocess.run([sys.executable, "-m", "steadyserve.cli", "serve", "--model", tiny_model, "--api-keys", path,
                        "--http-port", "0", "--grpc-port", "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--api-keys {path}: tenant[0] (a): weight must be" in r.stderr
    missing = str(tmp_path / "missing.toml")
    r = subprocess.run([sys.executable, "-m", "steadyserve.cli", "serve", "--api-keys", missing],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--api-keys {missing}: cannot read it" in r.stderr, r.stderr[-2000:]


def test_api_key_and_api_keys_are_one_or_the_other(tmp_path) -> None:
    args = build_parser().parse_args(["serve", "--api-key", "k", "--api-keys", str(tmp_path / "k.toml")])
    with pytest.raises(ConfigError, match="cannot be used together"):
        config_from_args(args)


def test_hash_key_prints_the_digest_a_keys_file_stores() -> None:
    cmd = [sys.executable, "-m", "steadyserve.cli", "hash-key"]
    r = subprocess.run(cmd, input="my secret\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == hash_key("my secret") and "my secret" not in r.stdout
    r = subprocess.run(cmd + ["--new"], capture_output=True, text=True, timeout=60)
    key, digest = (line.split()[1] for line in r.stdout.splitlines())
    assert r.returncode == 0 and digest == hash_key(key) and len(key) > 40


# ---- each tenant's own limits, on a fake clock ----------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_concurrency_is_per_tenant_and_undo_gives_the_seat_back() -> None:
    q = TenantQuotas(Clock())
    a, b = Tenant("a", max_concurrent=2), Tenant("b", max_concurrent=1)
    q.admit(a, 2, 10)
    with pytest.raises(Refused) as e:
        q.admit(a, 1, 10)
    assert e.value.reason == "tenant_concurrency" and e.value.retry_after == 1.0
    q.admit(b, 1, 10)  # another tenant's seats are its own
    q.undo(b, 1, 10)
    q.admit(b, 1, 10)
    q.finished("a")
    q.admit(a, 1, 10)
    assert q.in_flight("a") == 2 and q.in_flight("b") == 1


def test_token_buckets_admit_until_empty_and_say_when_they_refill() -> None:
    clock = Clock()
    q = TenantQuotas(clock)
    t = Tenant("t", prompt_tokens_per_minute=600, output_tokens_per_minute=60)
    q.admit(t, 1, 500)
    q.admit(t, 1, 500)  # 100 left: admitted, and 400 in debt
    with pytest.raises(Refused) as e:
        q.admit(t, 1, 1)
    assert e.value.reason == "tenant_prompt_tokens" and "prompt_tokens_per_minute (600)" in str(e.value)
    assert e.value.retry_after == pytest.approx(40.1)  # 400 tokens of debt at 10/s, and one more
    clock.t += 41
    q.admit(t, 1, 1)
    q.generated("t", 61)  # output: counted as generated, one over the minute's 60
    with pytest.raises(Refused) as e:
        q.admit(t, 1, 1)
    assert e.value.reason == "tenant_output_tokens" and e.value.retry_after == pytest.approx(2.0)
    other = Tenant("u", output_tokens_per_minute=60)
    q.admit(other, 1, 1)  # not another tenant's bucket
    clock.t += 2.5
    q.admit(t, 1, 1)


def test_past_three_quarters_of_capacity_a_tenant_gets_only_its_weighted_share() -> None:
    """Capacity 8, weights 3 (flood) and 1 (other): a lone flood fills 6 seats (75%), then gets tenant_share;
    the other tenant is still admitted up to the whole capacity."""
    q = TenantQuotas(Clock())
    flood, other = Tenant("flood", weight=3.0), Tenant("other")
    total = 0
    for _ in range(6):
        q.admit(flood, 1, 1, Load(total, 8, 4.0))
        total += 1
    with pytest.raises(Refused) as e:
        q.admit(flood, 1, 1, Load(total, 8, 4.0))  # share 8 * 3/4 = 6: it holds 6
    assert e.value.reason == "tenant_share" and "share (6.0, by weight)" in str(e.value)
    q.admit(other, 1, 1, Load(total, 8, 4.0))
    q.admit(other, 1, 1, Load(total + 1, 8, 4.0))  # 2 = its share, the server full
    q.admit(flood, 1, 1, Load(2, 8, 4.0))  # below three quarters: whatever is free
    sole = TenantQuotas(Clock())
    for n in range(8):  # one tenant (--api-key): nothing kept back, the engine's own capacity refuses
        sole.admit(Tenant("default"), 1, 1, Load(n, 8, 1.0))
