"""The gateway routes only the OpenAI API paths (issue 13): Envoy answers every other path 404 by itself.

Worker control paths (vLLM's ``/reset_prefix_cache``, the simulated worker's ``/fault``, ``/metrics`` ...)
must never be reachable through Envoy, whatever the spelling of the path, and the picker must not even hear
of them.
"""

import asyncio
import json
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from bench.load import free_port
from router.discovery import WorkerSpec
from router.frontends.api_paths import API_PATHS
from router.frontends.envoy_config import bootstrap
from tests.envoy_helpers import envoy, gateway
from tests.sim_helpers import start_worker
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.sockets
ROOT = Path(__file__).resolve().parents[1]
EXT_PROC = "envoy.filters.http.ext_proc"
SYSTEM = "you are a helpful assistant and the system document says the answer is in the question " * 12
# every fault switch but "die": had any of them reached the worker, its state would show it
FAULT = {"health": 503, "slowdown": 50.0, "events": "stop", "drop_every": 1, "restart": True}
# (method, raw request target, JSON body or None): all must be answered 404 by Envoy
BLOCKED = [
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/fault", FAULT),
    ("GET", "/metrics", None),
    ("GET", "/health", None),
    ("GET", "/version", None),
    ("POST", "/tokenize/../fault", FAULT),  # /tokenize itself is served: by the picker, from its own tokenizer
    ("POST", "/v1/../fault", FAULT),
    ("POST", "/v1/completions/../../fault", FAULT),
    ("POST", "/v1/completions/../../reset_prefix_cache", None),
    ("POST", "/v1/%2e%2e/fault", FAULT),
    ("POST", "//fault", FAULT),
    ("POST", "/fault?next=/v1/completions", FAULT),
    ("POST", "/v1/completions%2F..%2F..%2Ffault", FAULT),
    ("GET", "/", None),
]


def hcm_of(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def spec(w, wid: str) -> WorkerSpec:
    return WorkerSpec(wid, w.url, w.publisher.endpoint, w.publisher.replay_endpoint)


async def raw_request(base: str, method: str, target: str, body: dict | None = None) -> tuple[int, bytes]:
    """An HTTP/1.1 request with the target sent byte for byte (aiohttp/yarl would resolve the dot segments)."""
    u = urlsplit(base)
    data = json.dumps(body).encode() if body is not None else b""
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        # read by Content-Length: waiting for EOF would wait out Envoy's delayed close (1 s)
        payload = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10)
    finally:
        writer.close()
    return int(lines[0].split(" ", 2)[1]), payload


async def ext_proc_streams(admin_port: int) -> int:
    async with aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{admin_port}/stats?format=json&filter=ext_proc.streams_started") as r:
        stats = (await r.json())["stats"]
    return sum(int(st.get("value", 0)) for st in stats if st.get("name", "").endswith("ext_proc.streams_started"))


def worker_state(w) -> dict:
    """What a control path would change on a simulated worker."""
    return {"health": w.worker.faults.health_status, "slowdown": w.worker.faults.slowdown,
            "events_paused": w.publisher.paused, "drop_every": w.publisher.drop_every,
            "cached_blocks": len(w.worker.engine.pool.cached)}


def assert_envoy_404(status: int, payload: bytes, what: str) -> None:
    assert status == 404, (what, status, payload)
    err = json.loads(payload)  # Envoy's direct_response, never a worker's or the picker's answer
    assert err["object"] == "error" and err["type"] == "NotFoundError" and err["code"] == 404, (what, err)
    assert "/v1/completions" in err["message"]


# ---- the generated config, no Envoy ------------------------------------------------------------------------
@pytest.mark.parametrize("with_picker", [True, False])
@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_every_route_is_an_exact_api_path_or_the_404_catch_all(with_picker, body_mode):
    cfg = bootstrap(listen_port=1, admin_port=2, picker_port=3, workers=["127.0.0.1:8000"],
                    body_mode=body_mode, with_picker=with_picker)
    hcm = hcm_of(cfg)
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ([EXT_PROC] if with_picker else []) + ["envoy.filters.http.router"]
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    routes = vhost["routes"]
    *api, catch_all = routes
    for r in api:
        assert set(r["match"]) == {"path"}, r["match"]  # exact, case-sensitive, query string ignored by Envoy
        assert r["match"]["path"] in API_PATHS
        assert r["route"]["cluster"] == "inference_pool" and "direct_response" not in r
        assert "typed_per_filter_config" not in r  # the picker sees every API request
    assert sorted(r["match"]["path"] for r in api) == sorted(API_PATHS)
    # the last route takes everything else and answers it itself
    assert catch_all["match"] == {"prefix": "/"} and "route" not in catch_all
    assert catch_all["direct_response"]["status"] == 404
    err = json.loads(catch_all["direct_response"]["body"]["inline_string"])
    assert err["object"] == "error" and err["type"] == "NotFoundError" and err["code"] == 404
    per_filter = catch_all.get("typed_per_filter_config", {})
    if with_picker:
        assert per_filter[EXT_PROC]["disabled"] is True
        assert per_filter[EXT_PROC]["@type"].endswith("envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute")
    else:
        assert EXT_PROC not in per_filter
    # no route anywhere can reach the pool except through an exact API path
    assert not any(r.get("route") and set(r["match"]) != {"path"} for r in routes)
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True  # "/v1/../fault" is matched as "/fault"


def test_the_httproute_matches_only_the_api_paths_exactly():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "inferencepool.yaml").read_text()) if d]
    (route,) = [d for d in docs if d["kind"] == "HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    paths = []
    for rule in route["spec"]["rules"]:
        assert rule["backendRefs"] and all(b["kind"] == "InferencePool" for b in rule["backendRefs"])
        assert rule["matches"], "a rule without matches would match every path"
        for m in rule["matches"]:
            assert m["path"]["type"] == "Exact", m
            paths.append(m["path"]["value"])
    assert sorted(paths) == sorted(API_PATHS)


# ---- a real Envoy -------------------------------------------------------------------------------------------
@pytest.fixture
async def two_workers():
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    yield ws
    for w in ws:
        await w.stop()


async def test_control_paths_are_404_from_envoy_and_never_reach_the_picker_or_a_worker(two_workers, tmp_path):
    ws = two_workers
    specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
    async with gateway(specs, tmp_path) as (url, picker, cfg), aiohttp.ClientSession() as s:
        admin = cfg["admin"]["address"]["socket_address"]["port_value"]
        await asyncio.sleep(0.3)
        async with s.post(url + "/v1/completions", json={"prompt": SYSTEM, "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
        assert any(len(w.worker.engine.pool.cached) for w in ws)  # a cache a reset would empty
        await wait_until(lambda: not picker.core.load.inflight)
        before = [worker_state(w) for w in ws]
        finished = [w.worker.engine.stats.finished for w in ws]
        streams = await ext_proc_streams(admin)
        assert streams >= 1
        for method, target, body in BLOCKED:
            st, payload = await raw_request(url, method, target, body)
            assert_envoy_404(st, payload, f"{method} {target}")
        async with s.post(url + "/fault", json=FAULT) as r:
            assert r.status == 404 and r.content_type == "application/json"
            assert (await r.json())["type"] == "NotFoundError"
        assert await ext_proc_streams(admin) == streams  # ext_proc is off on the 404 route: no picker call
        assert [worker_state(w) for w in ws] == before  # no fault applied, no cache reset
        assert [w.worker.engine.stats.finished for w in ws] == finished
        for w in ws:  # the workers themselves still answer normally
            async with s.get(w.url + "/health") as r:
                assert r.status == 200
        # the API still works, query strings included (Envoy's exact path match ignores them)
        async with s.post(url + "/v1/completions", json={"prompt": SYSTEM + "q", "max_tokens": 2}) as r:
            assert r.status == 200
            assert json.loads(await r.read())["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        async with s.post(url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
        for target in ("/v1/models", "/v1/models?limit=1"):
            async with s.get(url + target) as r:
                assert r.status == 200 and (await r.json())["data"]
        assert await ext_proc_streams(admin) == streams + 4
        st, payload = await raw_request(url, "POST", "/v1/x/../completions", {"prompt": "hi", "max_tokens": 1})
        assert st == 200, payload  # dot segments resolved before routing: the worker gets /v1/completions
        assert [worker_state(w)["health"] for w in ws] == [200, 200]


async def test_the_baseline_without_a_picker_routes_only_the_api_paths(two_workers, tmp_path):
    ws = two_workers
    listen = free_port()
    cfg = bootstrap(listen_port=listen, admin_port=free_port(), picker_port=free_port(),
                    workers=[f"127.0.0.1:{w.port}" for w in ws], with_picker=False)
    url = f"http://127.0.0.1:{listen}"
    with envoy(cfg, tmp_path):
        before = [worker_state(w) for w in ws]
        for method, target, body in BLOCKED:
            st, payload = await raw_request(url, method, target, body)
            assert_envoy_404(st, payload, f"{method} {target}")
        assert [worker_state(w) for w in ws] == before
        async with aiohttp.ClientSession() as s:
            for i in range(2):  # round robin: both workers serve
                async with s.post(url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 1}) as r:
                    assert r.status == 200
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200
        assert all(w.worker.engine.stats.finished == 1 for w in ws)


def test_picker_streams_per_connection_caps_the_picker_cluster_only():
    cfg = bootstrap(listen_port=1, admin_port=2, picker_port=3, workers=["10.0.0.1:8000"],
                    picker_streams_per_connection=4)
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    (options,) = clusters["kvrouter_epp"]["typed_extension_protocol_options"].values()
    assert options["explicit_http_config"]["http2_protocol_options"] == {"max_concurrent_streams": 4}
    plain = bootstrap(listen_port=1, admin_port=2, picker_port=3, workers=["10.0.0.1:8000"])
    (options,) = {c["name"]: c for c in plain["static_resources"]["clusters"]}["kvrouter_epp"][
        "typed_extension_protocol_options"].values()
    assert options["explicit_http_config"]["http2_protocol_options"] == {}
    with pytest.raises(ValueError):
        bootstrap(listen_port=1, admin_port=2, picker_port=3, workers=["10.0.0.1:8000"],
                  picker_streams_per_connection=0)


def test_ext_proc_message_timeout_outlasts_the_pickers_queue(tmp_path, capsys):
    """A request held in the picker's flow-control queue is answered by the picker (served, or a 429 past its
    queue deadline), never cut off by Envoy's ext_proc message_timeout first."""
    from router.cli import main
    from router.frontends.envoy_config import message_timeout

    def timeout_of(cfg):
        (ext,) = [f for f in hcm_of(cfg)["http_filters"] if f["name"] == EXT_PROC]
        return ext["typed_config"]["message_timeout"]

    plain = bootstrap(listen_port=1, admin_port=2, picker_port=3, workers=["10.0.0.1:8000"])
    assert timeout_of(plain) == "5s"
    queued = bootstrap(listen_port=1, admin_port=2, picker_port=3, workers=["10.0.0.1:8000"], queue_timeout_s=30)
    assert timeout_of(queued) == "32s"
    assert message_timeout(1.0) == "5s" and message_timeout(60.5) == "62.5s"
    with pytest.raises(ValueError):
        message_timeout(0)
    # from the picker's own config file, only where flow control is on
    conf = tmp_path / "kvrouter.yaml"
    for enabled, want in ((True, "47s"), (False, "5s")):
        conf.write_text(f"flow_control: {{enabled: {str(enabled).lower()}, queue_timeout_s: 45}}\n")
        assert main(["envoy-config", "--endpoint", "10.0.0.1:8000", "--config", str(conf)]) == 0
        assert timeout_of(yaml.safe_load(capsys.readouterr().out)) == want
    conf.write_text("flow_control: {queue_timeout_s: -1}\n")
    assert main(["envoy-config", "--endpoint", "10.0.0.1:8000", "--config", str(conf)]) == 2
    assert "queue_timeout_s" in capsys.readouterr().err
