"""The ``kvrouter`` command line. Subcommands import their modules lazily so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _version() -> str:
    """The installed distribution's version; from a bare checkout, pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("kvrouter")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        try:
            pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
            return str(tomllib.loads(pyproject)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


class _OneValue(argparse.Action):
    """Stores like the default action; two spellings of one setting (``--port`` and the upstream EPP's
    ``--grpc-port``) given different values are an error. One spelling repeated keeps the last, as usual."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None, shown: str | None = None) -> None:
        seen = namespace.__dict__.setdefault("_spellings", {})
        shown = shown or f"{option_string} {values}"
        prev = seen.get(self.dest)
        if prev is not None and prev[0] != option_string and None not in (prev[1], values) and prev[1] != values:
            raise argparse.ArgumentError(None, f"{shown} conflicts with {prev[2]}: both set the same setting; "
                                         "give one of them")
        seen[self.dest] = (option_string, values, shown)
        setattr(namespace, self.dest, values)


class _Verbosity(_OneValue):
    """The upstream EPP's ``--v N`` (klog verbosity) as a log level: 0-1 warning, 2-3 info, 4 and up debug."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None, shown: str | None = None) -> None:
        if not isinstance(values, int) or values < 0:
            raise argparse.ArgumentError(self, f"expected a verbosity of 0 or more, got {values!r}")
        level = "warning" if values < 2 else "info" if values < 4 else "debug"
        super().__call__(parser, namespace, level, option_string, f"{option_string} {values} (log level {level})")


def _unset_if_empty(text: str) -> str | None:
    return text or None  # the upstream EPP's empty --pool-namespace: not given ($NAMESPACE, then the default)


def _pool_group(text: str) -> str:
    if text != "inference.networking.k8s.io":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: kvrouter reads InferencePools of "
                                         "inference.networking.k8s.io/v1 only")
    return text


def _secure_serving(text: str) -> bool:
    value = {"1": True, "t": True, "true": True, "0": False, "f": False, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    if value:
        raise argparse.ArgumentTypeError("TLS is not supported: kvrouter epp serves plaintext gRPC (h2c); give "
                                         "--secure-serving=false and connect the gateway to the picker without TLS "
                                         "(docs/kubernetes.md)")
    return value


def _cert_path(text: str) -> str:
    raise argparse.ArgumentTypeError("not supported: kvrouter epp serves plaintext gRPC (h2c), without TLS "
                                     "certificates (docs/kubernetes.md)")


def _index_replay(args: argparse.Namespace) -> int:
    from router.events.replay_file import replay_file

    report = replay_file(args.file, block_size=args.block_size)
    data = report.as_json()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"{args.file}: {report.replay_frames} replay frames decoded, "
          f"{report.unattributed_malformed} unattributable malformed frames")
    for wid, w in data["workers"].items():
        blocks = ", ".join(f"{m}={n}" for m, n in w["blocks"].items())
        events = ", ".join(f"{t}={n}" for t, n in w["events"].items())
        print(f"worker {wid}: blocks[{blocks}] events[{events}] malformed={w['malformed']} gaps={w['gaps']}")
    return 0


def _worker_sim(args: argparse.Namespace) -> int:
    from workers.sim.cli import run

    return run(args)


def _sim(args: argparse.Namespace) -> int:
    from sim.cli import run

    return run(args)


def _calibrate(args: argparse.Namespace) -> int:
    from router.calibrate import main as calibrate_main

    return calibrate_main(args)


def _load_router_config(args: argparse.Namespace, extra: dict) -> object:
    from router.config import load_config
    from router.discovery import parse_worker_arg

    overrides = {
        "routing.policy": args.policy, "routing.block_size": args.block_size,
        "routing.stale_after_s": args.stale_after, "routing.max_inflight_requests": args.max_inflight,
        "workers_file": args.workers_file, "events_bind": args.events_bind,
        "events_bus": args.events_bus, "tokenizer": args.tokenizer,
        "tenant_header": args.tenant_header, "tenant_missing": args.tenant_missing,
        "max_model_len": args.max_model_len, "max_body_bytes": args.max_body_bytes,
        "kubernetes.pool": args.inference_pool,
        "kubernetes.namespace": args.namespace, "processes": args.processes, "load_bus": args.load_bus,
        "replica_id": args.replica_id, **extra,
    }
    import os

    # as the upstream EPP: no --pool-namespace (nor file or KVROUTER_ key): $NAMESPACE (the pod's, by fieldRef)
    epp = getattr(args, "command", None) == "epp"
    defaults = {"kubernetes.namespace": os.environ.get("NAMESPACE") or None} if epp else {}
    config = load_config(args.config, overrides, defaults=defaults)
    if args.worker:
        config.workers = [parse_worker_arg(w) for w in args.worker]
    if not config.workers and not config.workers_file and not config.kubernetes.pool:
        raise ValueError("no workers: give --worker URL (repeatable), --workers-file, --inference-pool "
                         "or a config file")
    return config


def _run_router(args: argparse.Namespace, command: str, extra: dict, runner: Callable) -> int:
    """Shared by serve and epp: logging, config (file + options) with clear errors, run until signalled."""
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _load_router_config(args, extra)
    except ValueError as e:
        print(f"kvrouter {command}: {e}", file=sys.stderr)
        return 2
    if config.processes > 1:  # a supervisor of N processes on one port (router/frontends/processes.py)
        from router.frontends.processes import supervise

        return supervise(command, config)
    from router.frontends.event_loop import run, until_signalled

    # SIGTERM or SIGINT: the router drains (not ready, no new connections, queued requests 429, requests in
    # flight finish within grace_s), then exits 0; a second signal cuts the drain short. (KeyboardInterrupt:
    # a Ctrl-C before the event loop is up.)
    with contextlib.suppress(KeyboardInterrupt):
        run(until_signalled(runner(config)))
    return 0


def _epp_overrides(args: argparse.Namespace) -> dict:
    return {"epp.port": args.port, "epp.health_port": args.health_port, "epp.metrics_port": args.metrics_port,
            "epp.admin_port": args.admin_port, "epp.rank_port": args.rank_port}


def _epp(args: argparse.Namespace) -> int:
    from router.frontends.epp import run_epp

    return _run_router(args, "epp", _epp_overrides(args), run_epp)


def _envoy_config(args: argparse.Namespace) -> int:
    from router.config import ConfigError, load_config
    from router.frontends.envoy_config import bootstrap_yaml

    queue_timeout_s = None
    if args.config is not None:  # the picker's own config: ext_proc must wait as long as its queue holds
        try:
            flow = load_config(args.config, environ={}).flow_control
        except ConfigError as e:
            print(f"kvrouter envoy-config: {e}", file=sys.stderr)
            return 2
        queue_timeout_s = flow.queue_timeout_s if flow.enabled else None
    print(bootstrap_yaml(listen_port=args.listen_port, admin_port=args.admin_port, picker_port=args.picker_port,
                         workers=args.endpoint, body_mode=args.body_mode, fail_open=args.fail_open,
                         response_mode=args.response_mode,
                         picker_streams_per_connection=args.picker_streams_per_connection,
                         queue_timeout_s=queue_timeout_s), end="")
    return 0


def _routing_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action=_OneValue, help="YAML config file (docs/configuration.md)")
    p.add_argument("--worker", action="append", metavar="URL[,events=E][,replay=R][,id=ID][,model=M]",
                   help="a worker (repeatable); events/replay: its KV-event PUB and replay endpoints")
    p.add_argument("--workers-file", help="YAML/JSON list of workers, watched: edits add/remove workers live")
    p.add_argument("--events-bind", help="bind one SUB socket engines connect to (topic names the worker)")
    p.add_argument("--events-bus", metavar="nats://HOST:4222", help="take KV events from kvrouter relay on this "
                   "NATS JetStream instead of dialling the engines (docs/event-bus.md)")
    p.add_argument("--inference-pool", action=_OneValue,
                   help="discover workers as this InferencePool's pods (Kubernetes API)")
    p.add_argument("--namespace", action=_OneValue, help="namespace of the InferencePool (default: default)")
    p.add_argument("--policy", help="routing policy: precise (default), approx_prefix, least_loaded, "
                   "round_robin, session_hash, random")
    p.add_argument("--block-size", type=int, help="the engines' KV block size in tokens (default 16)")
    p.add_argument("--stale-after", type=float, help="seconds without events while loaded before a worker "
                   "loses prefix credit (default 10)")
    p.add_argument("--max-inflight", type=int, help="per-worker in-flight requests before shedding (default 512)")
    p.add_argument("--tokenizer", help="tokenizer.json or its directory (default: the bundled one)")
    p.add_argument("--tenant-header", help="trusted header whose value becomes the request's cache_salt; the "
                   "client's own cache_salt is then never used")
    p.add_argument("--tenant-missing", choices=["reject", "no_salt"], help="with --tenant-header, a request "
                   "without it: reject (400, default) or serve it with no cache_salt")
    p.add_argument("--max-model-len", type=int, help="refuse prompts longer than this many tokens before "
                   "tokenizing them (default: the largest max_model_len the workers report)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body accepted (default 32 MiB)")
    p.add_argument("--processes", type=int, help="run N processes on one port (SO_REUSEPORT), sharing their "
                   "in-flight load (default 1)")
    p.add_argument("--load-bus", metavar="nats://HOST:PORT", help="share in-flight load with the other replicas "
                   "over NATS core subjects")
    p.add_argument("--replica-id", help="this replica's name on the load bus (default: host-pid)")
    p.add_argument("--log-level", default="warning", type=str.lower, action=_OneValue,
                   help="debug, info, warning (default), error")


def _serve(args: argparse.Namespace) -> int:
    from router.frontends.proxy import run_proxy

    return _run_router(args, "serve", {
        "listen.host": args.host, "listen.port": args.port, "admin.host": args.admin_host,
        "admin.port": args.admin_port}, run_proxy)


def _relay(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from router.events.relay import Relay, Retention, parse_relay_worker, run_relay
    from router.nats_connection import NatsAuth

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sources = [parse_relay_worker(w) for w in args.worker]
        auth = NatsAuth(user=args.bus_user, password_file=args.bus_password_file, token_file=args.bus_token_file,
                        nkeys_seed=args.bus_nkeys_seed, creds_file=args.bus_creds, tls_ca=args.bus_tls_ca,
                        tls_cert=args.bus_tls_cert, tls_key=args.bus_tls_key)
        auth.check()
    except ValueError as e:
        print(f"kvrouter relay: {e}", file=sys.stderr)
        return 2
    retention = Retention(args.retention_age, args.retention_bytes, max_consumers=args.max_consumers)
    relay = Relay(args.bus, sources, block_size=args.block_size, snapshot_interval_s=args.snapshot_interval,
                  retention=retention, outbox_limit=args.outbox, auth=auth if auth.configured else None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_relay(relay))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from router.doctor import main as doctor_main

    return doctor_main(args)


def _plugins(args: argparse.Namespace) -> int:
    import json

    from router.config import ConfigError, load_config
    from router.scheduling.profiles import describe

    try:
        config = load_config(args.config) if args.config else None
    except ConfigError as e:
        print(f"kvrouter plugins: {e}", file=sys.stderr)
        return 2
    out = describe(config.scheduling if config else None)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    for kind in ("filters", "scorers", "pickers"):
        print(f"{kind}:")
        for p in out[kind]:
            params = ", ".join(f"{q['name']}: {q['type']} = {q['default']!r}" for q in p["parameters"])
            print(f"  {p['type']:<14} {('(' + params + ')') if params else ''}")
            if p["doc"]:
                print(f"  {'':<14} {p['doc'].splitlines()[0]}")
    print("profiles:")
    for name, prof in out["profiles"].items():
        parts = [f"{q.get('type', q.get('ref'))}" + (f" x{q['weight']}" if "weight" in q else "")
                 for q in prof["plugins"]]
        print(f"  {name:<14} {' -> '.join(parts)}{'' if prof['builtin'] else '  (config)'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from bench.demo import main as demo_main

    return demo_main(args)


def _bench(args: argparse.Namespace) -> int:
    """Every ``kvrouter bench NAME`` lives in bench/NAME_bench.py with a ``main(args)``."""
    import importlib

    return importlib.import_module(f"bench.{args.sub}_bench").main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description="Cache-aware request router for LLM fleets.")
    parser.add_argument("--version", action="version", version=f"kvrouter {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    index = sub.add_parser("index", help="inspect the KV block index").add_subparsers(dest="sub", required=True)
    rep = index.add_parser("replay", help="feed a recorded event file through the decoder and index")
    rep.add_argument("file", help="recorded events (JSONL, as ../shared/fixtures/*/kv_events.jsonl)")
    rep.add_argument("--block-size", type=int, default=None, help="expected engine block size (default: any)")
    rep.add_argument("--json", action="store_true", help="print JSON with stable keys")
    rep.set_defaults(handler=_index_replay)

    worker = sub.add_parser("worker", help="run a worker").add_subparsers(dest="sub", required=True)
    ws = worker.add_parser("sim", help="simulated vLLM worker (OpenAI API + KV events) on the engine model")
    from workers.sim.cli import add_arguments

    add_arguments(ws)
    ws.set_defaults(handler=_worker_sim)

    dm = sub.add_parser("demo", help="simulated workers + proxy on this machine: compare policies, print a "
                        "table, write a chart")
    from bench.demo import add_arguments as demo_arguments

    demo_arguments(dm)
    dm.set_defaults(handler=_demo)

    sv = sub.add_parser("serve", help="OpenAI-compatible proxy that routes on KV-cache residency and load",
                        description="Every option overrides the same key of --config (YAML).")
    _routing_options(sv)
    sv.add_argument("--host", help="proxy listen address (default 0.0.0.0)")
    sv.add_argument("--port", type=int, help="proxy port (default 8000)")
    sv.add_argument("--admin-host", help="admin/debug listen address (default 127.0.0.1)")
    sv.add_argument("--admin-port", type=int, help="admin/debug port (default 8001)")
    sv.set_defaults(handler=_serve)

    ep = sub.add_parser("epp", help="Envoy ext_proc endpoint picker (Gateway API Inference Extension)",
                        description="Every option overrides the same key of --config (YAML). The upstream EPP's "
                        "flag names work too (docs/kubernetes.md); two spellings with different values are an "
                        "error.")
    _routing_options(ep)
    ep.add_argument("--port", "--grpc-port", type=int, action=_OneValue, help="ext_proc gRPC port (default 9002)")
    ep.add_argument("--health-port", "--grpc-health-port", type=int, action=_OneValue,
                    help="gRPC health port (default 9003)")
    ep.add_argument("--metrics-port", type=int, help="Prometheus metrics port (default 9090)")
    ep.add_argument("--admin-port", type=int, help="serve /admin/workers, /admin/drain, /admin/undrain here, on "
                    "admin.host (127.0.0.1); default: none")
    ep.add_argument("--rank-port", type=int, help="serve kvrouter.v1.Picker/Rank here, on admin.host (127.0.0.1); "
                    "default: none (it reports any tenant's cached blocks: never on the ext_proc port)")
    up = ep.add_argument_group("the upstream EPP's names (gateway-api-inference-extension cmd/epp)")
    up.add_argument("--pool-name", dest="inference_pool", action=_OneValue, help="= --inference-pool")
    up.add_argument("--pool-namespace", dest="namespace", type=_unset_if_empty, action=_OneValue,
                    help="= --namespace; empty or absent: the config file's or KVROUTER_ key, else "
                    "$NAMESPACE, else default")
    up.add_argument("--config-file", dest="config", action=_OneValue, help="= --config (kvrouter's YAML)")
    up.add_argument("--v", dest="log_level", type=int, action=_Verbosity, default=argparse.SUPPRESS,
                    metavar="N", help="verbosity as a log level: 0-1 warning, 2-3 info, 4+ debug")
    up.add_argument("--pool-group", type=_pool_group, help="only inference.networking.k8s.io (the default)")
    up.add_argument("--secure-serving", type=_secure_serving, nargs="?", const="true", metavar="BOOL",
                    help="only false: the picker serves plaintext gRPC")
    up.add_argument("--cert-path", type=_cert_path, help="not supported (no TLS)")
    ep.set_defaults(handler=_epp)

    rl = sub.add_parser("relay", help="publish engines' KV events on NATS JetStream for router replicas "
                        "(docs/event-bus.md)")
    rl.add_argument("--bus", required=True, metavar="nats://HOST:4222", help="the NATS JetStream server")
    rl.add_argument("--worker", action="append", required=True, metavar="ID,events=E[,replay=R][,topic=T]",
                    help="an engine to relay (repeatable); ID as the routers name the worker (or their --worker spec)")
    rl.add_argument("--block-size", type=int, default=16, help="the routers' routing.block_size (default 16)")
    rl.add_argument("--retention-age", type=float, default=3600.0, help="seconds the bus keeps records (3600)")
    rl.add_argument("--retention-bytes", type=int, default=1 << 30, help="bytes the bus keeps (1 GiB)")
    rl.add_argument("--max-consumers", type=int, default=65_536, help="the stream's consumer limit: each router "
                    "replica holds one per worker (65536; nats-server's own default is 1000)")
    rl.add_argument("--snapshot-interval", type=float, default=30.0, help="seconds between index snapshots (30)")
    rl.add_argument("--outbox", type=int, default=10_000, help="records held per worker while the bus is down; "
                    "beyond that they are dropped and the worker is unsynced (10000)")
    rl.add_argument("--log-level", default="info", type=str.lower, help="debug, info (default), warning, error")
    au = rl.add_argument_group("bus authentication (docs/event-bus.md); secrets are read from files, never argv")
    au.add_argument("--bus-user", help="NATS user (with --bus-password-file)")
    au.add_argument("--bus-password-file", metavar="FILE", help="file holding the NATS user's password")
    au.add_argument("--bus-token-file", metavar="FILE", help="file holding a NATS token")
    au.add_argument("--bus-nkeys-seed", metavar="FILE", help="file holding the relay's nkey seed (SU...)")
    au.add_argument("--bus-creds", metavar="FILE", help="a NATS .creds file (user JWT and seed)")
    au.add_argument("--bus-tls-ca", metavar="PEM", help="CA the server's certificate must chain to")
    au.add_argument("--bus-tls-cert", metavar="PEM", help="client certificate for mutual TLS")
    au.add_argument("--bus-tls-key", metavar="PEM", help="the client certificate's key")
    rl.set_defaults(handler=_relay)

    ec = sub.add_parser("envoy-config", help="print an Envoy bootstrap that uses kvrouter epp (docs/envoy.md)")
    ec.add_argument("--listen-port", type=int, default=8080)
    ec.add_argument("--admin-port", type=int, default=9901)
    ec.add_argument("--picker-port", type=int, default=9002)
    ec.add_argument("--endpoint", action="append", required=True, help="ip:port of a worker (repeatable)")
    ec.add_argument("--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED")
    ec.add_argument("--config", default=None,
                    help="the picker's YAML config: with flow_control enabled, ext_proc's message_timeout outlasts "
                    "its queue_timeout_s (else 5 s)")
    ec.add_argument("--fail-open", action="store_true", help="failure_mode_allow: pass requests if the picker is down")
    ec.add_argument("--response-mode", choices=["full", "headers"], default="full",
                    help="headers: response bodies bypass the picker (lighter; no first-token timing or usage)")
    ec.add_argument("--picker-streams-per-connection", type=int, metavar="N",
                    help="cap ext_proc streams per HTTP/2 connection so Envoy opens several, which SO_REUSEPORT "
                    "spreads over a picker run with --processes (4 is a good start; default: no cap)")
    ec.set_defaults(handler=_envoy_config)

    sp = sub.add_parser("sim", help="trace-replay simulator: compare policies on engine models")
    from sim.cli import add_arguments as sim_arguments

    sim_arguments(sp)
    sp.set_defaults(handler=_sim)

    cb = sub.add_parser("calibrate", help="measure a live engine's step costs and write a timing file "
                        "(kvrouter sim --timing, routing.timing_file)")
    from router.calibrate import add_arguments as calibrate_arguments

    calibrate_arguments(cb)
    cb.set_defaults(handler=_calibrate)

    pl = sub.add_parser("plugins", help="list every registered filter, scorer, picker and profile")
    pl.add_argument("--config", help="YAML config whose scheduling section (imports, plugins, profiles) to include")
    pl.add_argument("--json", action="store_true", help='JSON: {"filters", "scorers", "pickers", "profiles"}')
    pl.set_defaults(handler=_plugins)

    dr = sub.add_parser("doctor", help="check each worker: /health, /v1/models, /metrics and block size, the KV-event "
                        "and replay sockets; exit 1 if a check fails",
                        description="Every option overrides the same key of --config (YAML).")
    dr.add_argument("--config", help="YAML config file whose workers (and routing.block_size) to check")
    dr.add_argument("--worker", action="append", metavar="URL[,events=E][,replay=R][,id=ID][,model=M]",
                    help="a worker (repeatable), as for serve; replaces the config's workers")
    dr.add_argument("--workers-file", help="YAML/JSON list of workers")
    dr.add_argument("--events-bind", help="the router binds this SUB socket and the engines connect to it")
    dr.add_argument("--block-size", type=int, help="the router's routing.block_size (default 16)")
    dr.add_argument("--wait", type=float, default=3.0, help="seconds to wait for a live KV-event batch (default 3)")
    dr.add_argument("--timeout", type=float, default=2.0, help="seconds per HTTP request, handshake and replay "
                    "reply (default 2)")
    dr.add_argument("--no-provoke", action="store_true", help="only listen: send no 1-token test request")
    dr.add_argument("--json", action="store_true", help='JSON: {"ok", "block_size", "checks": [...]}')
    dr.set_defaults(handler=_doctor)

    bench = sub.add_parser("bench", help="benchmarks that print a table (or --json)")
    bsub = bench.add_subparsers(dest="sub", required=True)
    benches = {  # each is bench/NAME_bench.py
        "index": "event ingest rate, match latency, index memory",
        "worker": "simulated worker requests/s at time-scale 0 on one core",
        "decide": "latency of one routing decision over 8/64/256 workers",
        "proxy": "added latency and req/s: direct vs kvrouter serve vs smg",
        "epp": "Envoy vs Envoy + kvrouter epp: added latency, req/s, CPU per pick",
        "quality": "live proxy routing quality over several workload seeds: precise vs round_robin, approx, smg",
        "soak": "the proxy for minutes under mixed load, bad input and worker kills: RSS, /health, 5xx; PASS/FAIL",
        "bus": "synthetic engine streams through relays and NATS JetStream into 2 replicas: block-events/s, exact",
        "replicas": "1, 2 and 4 proxy replicas on the event bus, shared load on and off: TTFT and hit rate",
        "fidelity": "one workload through the live proxy on real vLLM engines and through the simulator with "
                    "their calibrated timing: per policy sim/real TTFT, E2E, hit rate, rank agreement",
    }
    for name, help_text in benches.items():
        bp = bsub.add_parser(name, help=help_text)
        bp.add_argument("--json", action="store_true", help="print JSON with stable keys")
        bp.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
        if name in ("quality", "replicas"):
            bp.add_argument("--seeds", type=int, default=None,
                            help="workload seeds, every configuration on each (quality: 8, 2 with --quick; "
                            "replicas: 3, 1 with --quick)")
        if name == "decide":
            bp.add_argument("--policies", type=lambda v: v.split(","), default=None,
                            help="profiles timed at 64 workers beside precise (default precise,round_robin,random)")
            bp.add_argument("--baseline", help="a git revision to time in the same run, interleaved (e.g. HEAD~1)")
            bp.add_argument("--rounds", type=int, default=None, help="interleaved rounds with --baseline (3)")
        if name == "index":
            bp.add_argument("--blocks", type=int, default=None,
                            help="instead: build this many resident blocks once and measure (e.g. 20000000)")
            bp.add_argument("--workers", type=int, default=None, help="with --blocks: over this many (1000)")
            bp.add_argument("--layout", choices=["compact", "dicts"], default=None, help="with --blocks (compact)")
        if name == "bus":
            bp.add_argument("--streams", type=int, default=None, help="engine streams (default 1000; 20 with --quick)")
        if name == "fidelity":
            from bench.fidelity_bench import add_arguments as fidelity_arguments

            fidelity_arguments(bp)
        if name == "soak":
            bp.add_argument("--duration", type=float, default=None,
                            help="seconds of load (default 600; 60 with --quick)")
        bp.set_defaults(handler=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        parser.exit(2, f"kvrouter: error: {e.strerror}: {e.filename}\n")


if __name__ == "__main__":
    sys.exit(main())
