"""Kubernetes discovery through the official client, and the manifests under deploy/."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from kubernetes import watch

from router.discovery.kubernetes import PodSet, pool_selector
from router.frontends.fleet import Fleet
from router.scheduling import RoutingCore
from tests.zmq_helpers import wait_until

DATA = Path(__file__).parent / "data" / "k8s"
ROOT = Path(__file__).resolve().parents[1]


def test_podset_follows_a_recorded_watch_stream_through_the_client_models():
    podlist = json.loads((DATA / "pod_list.json").read_text())
    w = watch.Watch()
    podset = PodSet([8000])
    podset.replace([w.unmarshal_event(json.dumps({"type": "ADDED", "object": p}), "V1Pod")["object"]
                    for p in podlist["items"]])
    first = podset.workers()
    assert [s.worker_id for s in first] == ["vllm-llama-7c9d-qrs34", "vllm-llama-7c9d-xyz12"]
    a = next(s for s in first if s.worker_id.endswith("xyz12"))
    assert a.url == "http://10.244.1.7:8000" and a.events == "tcp://10.244.1.7:5557"
    assert a.replay == "tcp://10.244.1.7:5558" and a.models == frozenset({"llama-3-8b"})
    assert a.address == "10.244.1.7:8000"
    b = next(s for s in first if s.worker_id.endswith("qrs34"))
    assert b.events is None and b.replay is None  # annotated "none": routed on load only
    states = []
    for line in (DATA / "pod_watch.jsonl").read_text().splitlines():
        ev = w.unmarshal_event(line, "V1Pod")
        podset.apply(ev["type"], ev["object"])
        states.append(sorted(s.worker_id for s in podset.workers()))
    assert states[0] == states[1] == ["vllm-llama-7c9d-qrs34", "vllm-llama-7c9d-xyz12"]  # new pod not ready yet
    assert "vllm-llama-7c9d-abcde" in states[2]  # became Ready
    assert "vllm-llama-7c9d-xyz12" not in states[4]  # terminating: out before it is gone
    assert states[-1] == ["vllm-llama-7c9d-abcde", "vllm-llama-7c9d-qrs34"]


def test_podset_multiple_target_ports_and_pool_selector():
    pool = json.loads((DATA / "inferencepool.json").read_text())
    assert pool_selector(pool) == ("app=vllm-llama", [8000])
    pod = json.loads((DATA / "pod_list.json").read_text())["items"][0]
    ps = PodSet([8000, 8001])
    ps.apply("ADDED", pod)
    ws = ps.workers()
    assert [w.url for w in ws] == ["http://10.244.1.7:8000", "http://10.244.1.7:8001"]
    assert [w.events for w in ws] == ["tcp://10.244.1.7:5557", "tcp://10.244.1.7:5558"]  # +rank, as vLLM DP
    with pytest.raises(ValueError, match="targetPorts"):
        pool_selector({"spec": {"selector": {"matchLabels": {"a": "b"}}}})


@pytest.mark.sockets
async def test_discovery_against_a_fake_api_server_updates_the_fleet(tmp_path):
    """The official client (list + watch) against a fake API server replaying the recorded objects."""
    podlist = (DATA / "pod_list.json").read_text()
    lines = (DATA / "pod_watch.jsonl").read_text().splitlines()
    release = asyncio.Event()
    seen = []

    async def pool(request):
        return web.Response(text=(DATA / "inferencepool.json").read_text(), content_type="application/json")

    async def pods(request):
        seen.append(dict(request.query))
        assert request.query.get("labelSelector") == "app=vllm-llama"
        if request.query.get("watch") not in ("true", "1", "True"):
            return web.Response(text=podlist, content_type="application/json")
        assert request.query.get("resourceVersion") == "200"  # watch from the list's version
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for line in lines:
            await resp.write(line.encode() + b"\n")
            await asyncio.sleep(0.05)
        await release.wait()
        return resp

    app = web.Application()
    app.add_routes([web.get("/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/llama", pool),
                    web.get("/api/v1/namespaces/llm/pods", pods)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "llm"}}]}))
    core = RoutingCore()
    fleet = Fleet(core, probe_interval_s=3600, kubernetes=("llm", "llama", True, str(kubeconfig)))
    try:
        await fleet.start()
        await wait_until(lambda: set(core.endpoints) == {"vllm-llama-7c9d-abcde", "vllm-llama-7c9d-qrs34"},
                         timeout=10)
        assert core.endpoints["vllm-llama-7c9d-abcde"].address == "10.244.1.9:8000"
        assert "vllm-llama-7c9d-abcde" in fleet.subscriber._tasks  # its KV events are subscribed
        assert "vllm-llama-7c9d-xyz12" not in fleet.subscriber._tasks  # and the deleted pod's dropped
        assert not core.endpoints["vllm-llama-7c9d-qrs34"].events
    finally:
        release.set()
        await fleet.stop()
        await runner.cleanup()
    assert any(q.get("watch") for q in seen)


BUILTIN_KINDS = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "HorizontalPodAutoscaler",
                 "ConfigMap", "PodDisruptionBudget", "StatefulSet"}


def manifests():
    docs = []
    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def kubernetes_validate(tmp_path, named_docs) -> None:
    """``kubernetes-validate --strict`` against Kubernetes 1.33 of (file name, document) pairs."""
    files = []
    for i, (name, doc) in enumerate(named_docs):
        f = tmp_path / f"{i}-{name}"
        f.write_text(yaml.safe_dump(doc))
        files.append(str(f))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.33.0", *files],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_builtin_manifests_validate_against_the_kubernetes_schema(tmp_path):
    docs = [(n, d) for n, d in manifests() if d["kind"] in BUILTIN_KINDS]
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                                            "HorizontalPodAutoscaler"}
    kubernetes_validate(tmp_path, docs)


def test_custom_resources_have_the_fields_their_apis_require():
    docs = {d["kind"]: d for _, d in manifests()}
    pool = docs["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector, ports = pool_selector(pool)
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] in ("FailOpen", "FailClose") and ref["port"]["number"] == 9002
    picker_svc = next(d for _, d in manifests() if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"])
    assert {p["port"] for p in picker_svc["spec"]["ports"]} >= {9002, 9003, 9090}
    worker = next(d for _, d in manifests() if d["kind"] == "Deployment" and "vllm" in d["metadata"]["name"])
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in (kv.split("=") for kv in selector.split(",")))
    assert ports[0] in {p["containerPort"] for c in worker["spec"]["template"]["spec"]["containers"]
                        for p in c["ports"]}
    args = " ".join(worker["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--enable-prefix-caching" in args and "enable_kv_cache_events" in args
    keda = docs["ScaledObject"]
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["spec"]["triggers"][0]["type"] == "prometheus"
    # least privilege: read-only, and only what discovery needs
    role = docs["Role"]
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"pods", "inferencepools"}


def test_the_relay_sidecar_patch_makes_a_valid_engine_pod_whose_relay_names_the_worker_as_discovery_does(tmp_path):
    """deploy/patches/vllm-relay-sidecar.yaml merged into deploy/vllm.yaml's Deployment (a strategic merge adds
    the container) validates, and the relay's own parser reads its arguments: the worker id is the pod name
    (what InferencePool discovery calls the worker), the engine's sockets the ones vLLM binds."""
    from router.cli import build_parser
    from router.events.relay import parse_relay_worker

    engine = next(d for n, d in manifests() if n == "vllm.yaml" and d["kind"] == "Deployment")
    patch = yaml.safe_load((ROOT / "deploy" / "patches" / "vllm-relay-sidecar.yaml").read_text())
    (relay,) = patch["spec"]["template"]["spec"]["containers"]
    engine["spec"]["template"]["spec"]["containers"].append(relay)
    kubernetes_validate(tmp_path, [("vllm-with-relay.yaml", engine)])

    env = {e["name"]: e for e in relay["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = [a.replace("$(POD_NAME)", "vllm-llama-7d9f-abcde") for a in relay["args"]]
    parsed = build_parser().parse_args(args)
    (source,) = [parse_relay_worker(w) for w in parsed.worker]
    assert source.worker_id == "vllm-llama-7d9f-abcde"
    vllm_args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    events = json.loads(next(a for a in vllm_args if a.startswith("--kv-events-config=")).split("=", 1)[1])
    assert source.endpoint == events["endpoint"].replace("*", "127.0.0.1")
    assert source.replay_endpoint == events["replay_endpoint"].replace("*", "127.0.0.1")
    block = next(a for a in vllm_args if a.startswith("--block-size="))
    assert parsed.block_size == int(block.split("=")[1])
    bus = next(d for n, d in manifests() if n == "event-bus.yaml" and d["kind"] == "Service")
    assert parsed.bus == f"nats://{bus['metadata']['name']}.{bus['metadata']['namespace']}.svc:4222"
