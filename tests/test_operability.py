"""Operability: the upstream EPP's flag names, KVROUTER_* environment variables, --version, the Helm chart
(deploy/helm/kvrouter-epp) and the Grafana dashboard (deploy/grafana) against a real scrape."""

import asyncio
import copy
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.cli import _epp_overrides, _load_router_config, _version, build_parser
from router.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "kvrouter-epp"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvrouter-dashboard.json"
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """No KVROUTER_* or NAMESPACE from the machine running the tests."""
    import os

    for var in list(os.environ):
        if var.upper().startswith("KVROUTER_") or var == "NAMESPACE":
            monkeypatch.delenv(var)


def parse(argv):
    return build_parser().parse_args(argv)


def epp_config(argv):
    args = parse(["epp", *argv])
    return args, _load_router_config(args, _epp_overrides(args))


def parse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ---- the upstream EPP's flags ---------------------------------------------------------------------------------

def test_upstream_epp_flags_set_the_same_keys_as_kvrouters_own(tmp_path):
    cfg_file = tmp_path / "kvrouter.yaml"
    cfg_file.write_text("routing: {policy: least_loaded, block_size: 32}\nepp: {fallbacks: 1}\n")
    upstream, a = epp_config(["--grpc-port", "9102", "--grpc-health-port", "9103", "--metrics-port", "9190",
                              "--pool-name", "llama", "--pool-namespace", "llm", "--config-file", str(cfg_file),
                              "--v", "3", "--pool-group", "inference.networking.k8s.io", "--secure-serving=false"])
    ours, b = epp_config(["--port", "9102", "--health-port", "9103", "--metrics-port", "9190",
                          "--inference-pool", "llama", "--namespace", "llm", "--config", str(cfg_file),
                          "--log-level", "info"])
    assert a == b
    assert (a.epp.port, a.epp.health_port, a.epp.metrics_port) == (9102, 9103, 9190)
    assert (a.kubernetes.pool, a.kubernetes.namespace) == ("llama", "llm")
    assert (a.routing.policy, a.routing.block_size, a.epp.fallbacks) == ("least_loaded", 32, 1)  # the file's
    assert upstream.log_level == ours.log_level == "info"
    # the same value under both spellings is no conflict
    _, c = epp_config(["--port", "9102", "--grpc-port", "9102", "--pool-name", "llama"])
    assert c.epp.port == 9102


@pytest.mark.parametrize(("v", "level"), [(0, "warning"), (1, "warning"), (2, "info"), (3, "info"), (4, "debug"),
                                          (9, "debug")])
def test_v_verbosity_maps_to_a_log_level(v, level):
    assert parse(["epp", "--v", str(v)]).log_level == level
    assert parse(["epp", f"--v={v}", "--log-level", level.upper()]).log_level == level  # agreeing: fine
    assert parse(["epp"]).log_level == "warning"


@pytest.mark.parametrize("argv", [
    ["--port", "9002", "--grpc-port", "9012"],
    ["--grpc-health-port", "9003", "--health-port", "9013"],
    ["--inference-pool", "a", "--pool-name", "b"],
    ["--pool-namespace", "a", "--namespace", "b"],
    ["--config", "a.yaml", "--config-file", "b.yaml"],
    ["--log-level", "debug", "--v", "1"],
])
def test_two_spellings_with_different_values_are_an_error(capsys, argv):
    err = parse_error(capsys, ["epp", *argv])
    assert "conflicts with" in err and argv[0] in err and argv[2] in err


@pytest.mark.parametrize(("argv", "says"), [
    (["--secure-serving"], "TLS is not supported"),
    (["--secure-serving=true"], "TLS is not supported"),
    (["--secure-serving=maybe"], "expected true or false"),
    (["--cert-path", "/etc/tls"], "not supported"),
    (["--pool-group", "inference.networking.x-k8s.io"], "inference.networking.k8s.io/v1 only"),
    (["--v", "-1"], "verbosity of 0 or more"),
])
def test_upstream_flags_kvrouter_cannot_honour_are_clear_errors(capsys, argv, says):
    err = parse_error(capsys, ["epp", *argv])
    assert says in err and argv[0].split("=")[0] in err


def test_pool_namespace_falls_back_to_NAMESPACE_as_upstream(monkeypatch, tmp_path):
    monkeypatch.setenv("NAMESPACE", "llm")
    assert epp_config(["--pool-name", "p"])[1].kubernetes.namespace == "llm"
    assert epp_config(["--pool-name", "p", "--pool-namespace", ""])[1].kubernetes.namespace == "llm"  # empty: unset
    assert epp_config(["--pool-name", "p", "--pool-namespace", "other"])[1].kubernetes.namespace == "other"
    f = tmp_path / "c.yaml"
    f.write_text("kubernetes: {namespace: from-file}\n")
    assert epp_config(["--pool-name", "p", "--config", str(f)])[1].kubernetes.namespace == "from-file"
    monkeypatch.setenv("KVROUTER_KUBERNETES__NAMESPACE", "from-env")
    assert epp_config(["--pool-name", "p", "--config", str(f)])[1].kubernetes.namespace == "from-env"
    monkeypatch.delenv("KVROUTER_KUBERNETES__NAMESPACE")
    serve = parse(["serve", "--inference-pool", "p"])  # only the picker takes the upstream EPP's convention
    assert _load_router_config(serve, {}).kubernetes.namespace == "default"


def test_the_upstream_plugin_config_file_is_named_for_what_it_is(tmp_path):
    f = tmp_path / "plugins.yaml"
    f.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\n")
    with pytest.raises(ConfigError, match="EndpointPickerConfig"):
        epp_config(["--config-file", str(f), "--pool-name", "p"])


# ---- --version ------------------------------------------------------------------------------------------------

def test_version_prints_the_distribution_version():
    from importlib import metadata

    out = subprocess.run([sys.executable, "-m", "router.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvrouter {metadata.version('kvrouter')}"
    assert re.fullmatch(r"kvrouter \d+\.\d+\.\d+\S*", out.stdout.strip())


def test_version_falls_back_to_pyproject_without_an_installed_distribution(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert _version() == PYPROJECT_VERSION


# ---- KVROUTER_* environment variables ---------------------------------------------------------------------------

def test_environment_sits_between_the_file_and_the_options(monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("routing: {policy: least_loaded, block_size: 32}\nlisten: {port: 8100}\ntenant_header: x-org\n"
                 "max_attempts: 2\n")
    monkeypatch.setenv("KVROUTER_ROUTING__POLICY", "round_robin")
    monkeypatch.setenv("KVROUTER_LISTEN__PORT", "9000")
    monkeypatch.setenv("KVROUTER_MAX_ATTEMPTS", "5")
    args = parse(["serve", "--config", str(f), "--worker", "http://127.0.0.1:1", "--policy", "random"])
    cfg = _load_router_config(args, {"listen.port": args.port})
    assert cfg.routing.policy == "random"  # option > environment > file
    assert cfg.listen.port == 9000 and cfg.max_attempts == 5  # environment > file
    assert cfg.routing.block_size == 32 and cfg.tenant_header == "x-org"  # the file's, untouched
    args = parse(["serve", "--config", str(f), "--worker", "http://127.0.0.1:1", "--port", "9100"])
    assert _load_router_config(args, {"listen.port": args.port}).listen.port == 9100


def test_environment_nested_keys_types_and_case():
    env = {"KVROUTER_ROUTING__COST__LEARN": "false", "KVROUTER_KUBERNETES__EVENTS_BY_DEFAULT": "false",
           "KVROUTER_MAX_MODEL_LEN": "null", "kvrouter_admin__host": "0.0.0.0", "KVROUTER_TENANT_HEADER": "x-tenant",
           "KVROUTER_ROUTING__MAX_INFLIGHT_TOKENS": "~", "KVROUTER_ROUTING__STALE_AFTER_S": "2.5",
           "KVROUTER_TOKENIZERS": "{llama: /models/llama}", "KVROUTER_WORKERS": "[{url: 'http://10.0.0.1:8000', "
           "events: 'tcp://10.0.0.1:5557'}]", "KVROUTER_EVENTS_BIND": "tcp://*:5557"}
    cfg = load_config(None, environ=env)
    assert cfg.routing.cost.learn is False and cfg.kubernetes.events_by_default is False
    assert cfg.max_model_len is None and cfg.routing.max_inflight_tokens is None
    assert cfg.admin.host == "0.0.0.0" and cfg.tenant_header == "x-tenant" and cfg.routing.stale_after_s == 2.5
    assert cfg.tokenizers == {"llama": "/models/llama"} and cfg.events_bind == "tcp://*:5557"
    assert [(w.url, w.events) for w in cfg.workers] == [("http://10.0.0.1:8000", "tcp://10.0.0.1:5557")]
    # a string key keeps the text YAML would read as a number or boolean
    cfg = load_config(None, environ={"KVROUTER_TENANT_HEADER": "yes", "KVROUTER_KUBERNETES__NAMESPACE": "123"})
    assert cfg.tenant_header == "yes" and cfg.kubernetes.namespace == "123"


def test_environment_mapping_merges_into_the_files_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("routing: {policy: least_loaded, block_size: 32}\n")
    cfg = load_config(f, environ={"KVROUTER_ROUTING": "{stale_after_s: 5}", "KVROUTER_ROUTING__BLOCK_SIZE": "64"})
    assert (cfg.routing.policy, cfg.routing.block_size, cfg.routing.stale_after_s) == ("least_loaded", 64, 5.0)


@pytest.mark.parametrize(("env", "says"), [
    ({"KVROUTER_LISTEN__PORT": "abc"}, "KVROUTER_LISTEN__PORT: expected an integer, got 'abc'"),
    ({"KVROUTER_KUBERNETES__EVENTS_BY_DEFAULT": "maybe"}, "KVROUTER_KUBERNETES__EVENTS_BY_DEFAULT: expected true"),
    ({"KVROUTER_ROUTING__STALE_AFTER_S": "soon"}, "KVROUTER_ROUTING__STALE_AFTER_S: expected a number"),
    ({"KVROUTER_ROUTING__POLCY": "random"}, "KVROUTER_ROUTING__POLCY: routing has no key 'polcy'"),
    ({"KVROUTER_NOPE": "1"}, "KVROUTER_NOPE: the top level has no key 'nope'"),
    ({"KVROUTER_LISTEN__PORT__X": "1"}, "KVROUTER_LISTEN__PORT__X: listen.port is not a mapping"),
    ({"KVROUTER_ROUTING___POLICY": "random"}, "KVROUTER_ROUTING___POLICY"),
    ({"KVROUTER_LISTEN": "[1, 2]"}, "KVROUTER_LISTEN: expected a mapping"),
    ({"KVROUTER_ROUTING__BLOCK_SIZE": "@x"}, "KVROUTER_ROUTING__BLOCK_SIZE: not a valid YAML value"),
    ({"KVROUTER_ROUTING__POLICY": "bogus"}, "KVROUTER_ROUTING__POLICY"),  # a check across keys: named too
    ({"KVROUTER_TENANT_MISSING": "maybe"}, "set by KVROUTER_TENANT_MISSING"),
    ({"KVROUTER_TENANT_HEADER": "a", "kvrouter_tenant_header": "b"}, "give one of them"),
])
def test_environment_errors_name_the_variable(env, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, environ=env)
    assert says in str(e.value)


def test_environment_errors_stop_the_command_before_it_starts(monkeypatch, capsys):
    from router.cli import main

    monkeypatch.setenv("KVROUTER_ROUTING__BLOCK_SIZE", "sixteen")
    assert main(["epp", "--worker", "http://127.0.0.1:1"]) == 2
    assert "kvrouter epp: KVROUTER_ROUTING__BLOCK_SIZE: expected an integer" in capsys.readouterr().err


def test_variables_that_are_not_config_keys_are_ignored():
    env = {"KVROUTER_PORT": "tcp://10.96.0.12:8000", "KVROUTER_SERVICE_HOST": "10.96.0.12",  # a Service "kvrouter"
           "KVROUTER_EPP_SERVICE_PORT_GRPC": "9002", "KVROUTER_EPP_PORT_9002_TCP_ADDR": "10.96.0.13",
           "KVROUTER_EPP_PORT": "tcp://10.96.0.13:9002", "KVROUTER_VLLM_VENV": "/opt/venv", "OTHER": "x"}
    for port, name in ((9002, "GRPC"), (9003, "GRPC_HEALTH"), (9090, "METRICS")):  # deploy/picker.yaml's Service
        env[f"KVROUTER_EPP_SERVICE_PORT_{name}"] = str(port)
        env[f"KVROUTER_EPP_PORT_{port}_TCP"] = f"tcp://10.96.0.13:{port}"
        for part, value in (("PROTO", "tcp"), ("PORT", str(port)), ("ADDR", "10.96.0.13")):
            env[f"KVROUTER_EPP_PORT_{port}_TCP_{part}"] = value
    assert load_config(None, environ=env) == load_config(None, environ={})


# ---- the Helm chart ---------------------------------------------------------------------------------------------
# Rendered by a deliberately small substitution (no Go template engine): the chart's templates use only
# {{ .Values.a.b }}, {{ .Release.Name }}, {{ .Release.Namespace }}, {{ .Chart.* }} and
# {{- toYaml .Values.x | nindent N }}; anything else is an error here, which keeps the chart that simple.
# Where `helm` is installed, `helm template` must produce the same objects.

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def _lookup(ref: str, ctx: dict):
    node = ctx
    for part in ref.lstrip(".").split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"{ref}: no such value")
        node = node[part]
    return node


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return str(value)
    raise TypeError(f"{value!r}: render structures with toYaml")


def _to_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n").removesuffix("\n...")


def render_template(text: str, ctx: dict) -> str:
    out, pos = [], 0
    for m in _ACTION.finditer(text):
        before = text[pos:m.start()]
        out.append(before.rstrip() if m.group(1) else before)
        expr = m.group(2)
        if t := re.fullmatch(r"toYaml\s+(\.[\w.]+)\s*\|\s*nindent\s+(\d+)", expr):
            pad = " " * int(t.group(2))
            out.append("\n" + "\n".join(pad + line for line in _to_yaml(_lookup(t.group(1), ctx)).splitlines()))
        elif re.fullmatch(r"\.(Values|Release|Chart)(\.\w+)+", expr):
            out.append(_scalar(_lookup(expr, ctx)))
        else:
            raise ValueError(f"unsupported template action {{{{ {expr} }}}}: keep the chart's templates simple")
        pos = m.end()
        if m.group(3):
            while pos < len(text) and text[pos].isspace():
                pos += 1
    out.append(text[pos:])
    return "".join(out)


def _merge_values(base: dict, over: dict) -> dict:
    """Helm's: mappings merge, anything else replaces, null deletes."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_values(out[k], v)
        else:
            out[k] = v
    return out


def render_chart(release: str, namespace: str, overrides: dict | None = None) -> list[dict]:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = _merge_values(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})
    ctx = {"Values": values, "Release": {"Name": release, "Namespace": namespace},
           "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]}}
    docs = []
    for path in sorted((CHART / "templates").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(render_template(path.read_text(), ctx)) if d)
    return docs


def kubernetes_validate(tmp_path, docs):
    from tests.test_kubernetes import kubernetes_validate as validate

    validate(tmp_path, [(f"{doc['kind']}.yaml", doc) for doc in docs])


def test_chart_renderer_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="unsupported"):
        render_template("a: {{ include \"x\" . }}", {})
    with pytest.raises(KeyError):
        render_template("a: {{ .Values.nope }}", {"Values": {}})
    assert render_template("a:\n  {{- toYaml .Values.m | nindent 2 }}\n", {"Values": {"m": {"k": [1]}}}) == \
        "a:\n  k:\n  - 1\n"


@pytest.mark.parametrize(("release", "namespace", "overrides"), [
    ("kvrouter-epp", "llm", None),
    ("picker", "serving", {"replicas": 3, "verbosity": 4, "pool": {"name": "mistral", "namespace": "pools"},
                           "ports": {"grpc": 19002, "grpcHealth": 19003, "metrics": 19090},
                           "config": {"routing": {"policy": "approx_prefix"}, "tenant_header": "x-tenant"},
                           "tokenizer": {"path": "/models/mistral",
                                         "volume": {"configMap": None,
                                                    "persistentVolumeClaim": {"claimName": "models"}}},
                           "resources": {}, "nodeSelector": {"gpu": "none"}}),
])
def test_chart_renders_valid_manifests_the_picker_accepts(tmp_path, monkeypatch, release, namespace, overrides):
    docs = render_chart(release, namespace, overrides)
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"}
    kubernetes_validate(tmp_path, docs)
    values = _merge_values(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})
    dep, svc, cm = kinds["Deployment"], kinds["Service"], kinds["ConfigMap"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert dep["spec"]["replicas"] == values["replicas"]
    assert container["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    # the rendered args, config file and environment through the real command-line and config path
    args = list(container["args"])
    cfg_file = tmp_path / "kvrouter.yaml"
    cfg_file.write_text(cm["data"]["kvrouter.yaml"])
    args[args.index("/etc/kvrouter/kvrouter.yaml")] = str(cfg_file)
    assert {v["mountPath"] for v in container["volumeMounts"]} >= {"/etc/kvrouter", values["tokenizer"]["path"]}
    env = {e["name"]: e for e in container["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    monkeypatch.setenv("NAMESPACE", dep["metadata"]["namespace"])  # what the fieldRef gives the pod
    parsed = parse(args)
    assert parsed.command == "epp"
    cfg = _load_router_config(parsed, _epp_overrides(parsed))
    pool_ns = values["pool"]["namespace"] or namespace
    assert (cfg.kubernetes.pool, cfg.kubernetes.namespace) == (values["pool"]["name"], pool_ns)
    assert cfg.tokenizer == values["tokenizer"]["path"]
    assert cfg.routing.policy == values["config"]["routing"]["policy"]
    assert parsed.log_level == ("debug" if values["verbosity"] >= 4 else "warning")
    # ports: the picker's, the container's, the probes', the Service's and the scrape annotation agree
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": cfg.epp.port, "grpc-health": cfg.epp.health_port, "metrics": cfg.epp.metrics_port}
    assert ports["grpc"] == values["ports"]["grpc"]
    assert container["livenessProbe"]["grpc"] == {"port": cfg.epp.health_port, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": cfg.epp.health_port, "service": "readiness"}
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {n: n for n in ports}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.epp.metrics_port)
    # selectors, names, service account, volumes
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"] == labels
    assert svc["metadata"]["name"] == release
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert set(vols["tokenizer"]) - {"name"} == set(values["tokenizer"]["volume"])
    assert pod["enableServiceLinks"] is False
    for d in (dep, svc, cm, kinds["ServiceAccount"]):
        assert d["metadata"]["namespace"] == namespace
    # least privilege, where the pool is ("" is the release namespace: helm installs it there)
    role, binding = kinds["Role"], kinds["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == values["pool"]["namespace"]
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"pods", "inferencepools"}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": namespace}]


def test_chart_versions_follow_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvrouter-epp"
    assert chart["appVersion"] == values["image"]["tag"] == PYPROJECT_VERSION


# ---- the Grafana dashboard --------------------------------------------------------------------------------------

TARGET_LABELS = {"instance", "job", "pod", "namespace"}  # added by Prometheus at scrape time, not in /metrics
_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def promql_references(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """({metric name: labels its selector matches on}, labels grouped or matched by) of a PromQL expression,
    found lexically: strings, ranges and grouping clauses out, then selectors, then bare metric names."""
    for var, sub in _GRAFANA_VARS.items():
        expr = expr.replace(var, sub)
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    grouping: set[str] = set()

    def group(m):
        grouping.update(x.strip() for x in m.group(2).split(",") if x.strip())
        return " "

    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", group, text)
    text = re.sub(r"\b(group_left|group_right)\b", " ", text)
    names: dict[str, set[str]] = {}

    def selector(m):
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", m.group(2)))
        names.setdefault(m.group(1), set()).update(labels)
        return " "

    text = re.sub(r"(?<![\w:.])([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", selector, text)
    assert "{" not in text, f"a selector without a metric name in {expr!r}"
    keywords = {"by", "without", "on", "ignoring", "bool", "and", "or", "unless", "offset", "inf", "nan"}
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text):
        if m.group(1).lower() not in keywords:
            names.setdefault(m.group(1), set())
    return names, grouping


def _ast_references(node, out: dict[str, set[str]]) -> None:
    kind = type(node).__name__
    if kind == "VectorSelector":
        out.setdefault(node.name, set()).update(m.name for m in node.matchers.matchers)
    elif kind == "MatrixSelector":
        _ast_references(node.vector_selector, out)
    elif kind == "Call":
        for a in node.args:
            _ast_references(a, out)
    elif kind == "BinaryExpr":
        _ast_references(node.lhs, out)
        _ast_references(node.rhs, out)
    elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        _ast_references(node.expr, out)
        if getattr(node, "param", None) is not None:
            _ast_references(node.param, out)


def dashboard():
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    d = dashboard()
    out = [(f"panel {p['title']!r}", t["expr"]) for p in d["panels"] for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\(\s*([^,]+?)\s*,\s*(\w+)\s*\)", q)
            assert m, f"variable {var['name']}: {q}"
            out.append((f"variable ${var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


def _substitute_variables(expr: str) -> str:
    for var, sub in _GRAFANA_VARS.items():
        expr = expr.replace(var, sub)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def test_dashboard_structure():
    d = dashboard()
    ds = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert len(ds) == 1 and ds[0]["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": f"${{{ds[0]['name']}}}"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    names_used = set()
    for p in d["panels"]:
        assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"] == ref and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ref and t["refId"]
            names, _ = promql_references(t["expr"])
            assert names, t["expr"]
            names_used |= set(names)
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == ref
    series = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names_used}
    assert series >= {
        "kvrouter_time_to_first_token_seconds", "kvrouter_prefix_hit_tokens_estimated",
        "kvrouter_prefix_hit_tokens_reported", "kvrouter_prompt_tokens", "kvrouter_worker_index_state",
        "kvrouter_decisions", "kvrouter_requests", "kvrouter_worker_inflight_requests",
        "kvrouter_worker_pending_prefill_tokens", "kvrouter_decision_seconds", "kvrouter_responses_truncated",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:time_to_first_token_seconds"}


def test_dashboard_queries_parse_as_promql():
    promql_parser = pytest.importorskip("promql_parser", reason="pip install promql-parser for the full parse")
    for where, expr in dashboard_queries():
        try:
            tree = promql_parser.parse(_substitute_variables(expr))
        except ValueError as e:
            pytest.fail(f"{where}: {expr}: {e}")
        found: dict[str, set[str]] = {}
        _ast_references(tree, found)
        names, _ = promql_references(_substitute_variables(expr))
        assert found == names, where  # the lexical reading the live test relies on agrees with the parser


def _scrape(text: str) -> dict[str, set[str]]:
    """{sample name: label names} of a Prometheus text exposition, by prometheus_client's parser."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


@pytest.mark.sockets
async def test_every_series_the_dashboard_reads_is_in_a_real_scrape():
    from tests.sim_helpers import start_worker
    from tests.test_proxy import SYSTEM, post, proxy, spec_of

    ws = [await start_worker(time_scale=0.0, topic=f"w{i}") for i in range(2)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (_, url, _admin):
            await asyncio.sleep(0.3)  # subscriptions settle
            async with aiohttp.ClientSession() as s:
                for i in range(3):
                    st, _, _ = await post(s, url + "/v1/completions",
                                          {"prompt": SYSTEM + f"question {i}", "max_tokens": 2})
                    assert st == 200
                async with s.get(url + "/metrics") as r:
                    router = _scrape(await r.text())
                async with s.get(ws[0].url + "/metrics") as r:
                    engine = _scrape(await r.text())
    finally:
        for w in ws:
            await w.stop()
    checked = set()
    for where, expr in dashboard_queries():
        names, grouping = promql_references(expr)
        for name, labels in names.items():
            scrape = router if name.startswith("kvrouter_") else engine if name.startswith("vllm:") else None
            assert scrape is not None, f"{where}: {name} is neither the router's nor vLLM's"
            assert name in scrape, f"{where}: {name} is not in a real /metrics scrape"
            assert labels <= scrape[name] | TARGET_LABELS, f"{where}: {name} has no label {labels - scrape[name]}"
            checked.add(name)
        have = set().union(*(router.get(n, set()) | engine.get(n, set()) for n in names)) | TARGET_LABELS
        assert grouping <= have, f"{where}: grouped by {grouping - have}, which none of {sorted(names)} has"
    assert any(n.startswith("kvrouter_") for n in checked) and any(n.startswith("vllm:") for n in checked)
