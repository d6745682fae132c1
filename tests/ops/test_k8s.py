"""ops/k8s: every manifest is valid against the Kubernetes schema (kubernetes-validate, strict:
an unknown field fails), a broken one is caught, and the kvserve pod's command line with its
ConfigMap's kvserve.toml is a config `kvserve serve` accepts, publishing KV events on the
pod's IP where its frontend reports them to the router."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.config.serve import load_serve_config
from kvserve.serve.main import build_parser

from .opsfiles import OPS

K8S = OPS / "k8s"
VERSION = "1.33.0"
POD_IP = "10.1.2.3"


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}", doc)
                for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _one(kind: str, name: str) -> dict:
    return next(doc for _, doc in _docs() if doc["kind"] == kind and doc["metadata"]["name"] == name)


def test_the_manifests_are_there() -> None:
    kinds = sorted((doc["kind"], doc["metadata"]["name"]) for _, doc in _docs())
    assert ("StatefulSet", "kvserve") in kinds and ("Deployment", "vllm-router") in kinds
    assert ("NetworkPolicy", "kvserve-node") in kinds and ("Role", "vllm-router") in kinds


@pytest.mark.parametrize(("where", "doc"), _docs(), ids=[w for w, _ in _docs()])
def test_every_manifest_is_valid(where: str, doc: dict) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_a_broken_manifest_is_caught() -> None:
    doc = copy.deepcopy(_one("StatefulSet", "kvserve"))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSION, strict=True)
    doc = copy.deepcopy(_one("StatefulSet", "kvserve"))
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_node_pod_is_what_the_router_and_prometheus_need() -> None:
    pod = _one("StatefulSet", "kvserve")["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "http": 8000, "metrics": 9400, "metrics-memsvc": 9401, "metrics-runner": 9402,
                     "kv-events": 5557, "kv-replay": 5558}
    assert c["readinessProbe"]["grpc"]["port"] == 50051 and c["livenessProbe"]["httpGet"]["port"] == "http"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]
    router = _one("Deployment", "vllm-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--service-discovery" in router and "--policy=kv_aware" in router
    assert "--service-discovery-port=8000" in router
    labels = pod["metadata"]["labels"]
    selector = router[router.index("--selector") + 1: router.index("--service-discovery-port=8000")]
    assert dict(s.split("=") for s in selector).items() <= labels.items()


def test_the_node_command_is_a_config_serve_accepts(tmp_path: Path) -> None:
    (c,) = _one("StatefulSet", "kvserve")["spec"]["template"]["spec"]["containers"]
    toml = tmp_path / "kvserve.toml"
    toml.write_text(_one("ConfigMap", "kvserve-config")["data"]["kvserve.toml"])
    argv = [a.replace("$(POD_IP)", POD_IP).replace("/etc/kvserve/kvserve.toml", str(toml)) for a in c["args"]]
    assert argv[0] == "serve"
    args = build_parser().parse_args(argv[1:])
    cfg = load_serve_config(toml_path=args.config, flags=vars(args), env={})
    assert cfg.memsvc.kv_events_endpoint == f"tcp://{POD_IP}:5557"
    assert cfg.memsvc.kv_events_plaintext and cfg.memsvc.allow_remote
    # what GET /kv_event_sources tells the router
    assert cfg.frontend.kv_events_replay_endpoint == f"tcp://{POD_IP}:5558"
    assert (cfg.frontend.host, cfg.frontend.port, cfg.frontend.http_port) == ("0.0.0.0", 50051, 8000)
