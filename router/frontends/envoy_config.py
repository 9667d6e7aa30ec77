"""Envoy bootstrap for the endpoint picker: listener -> ext_proc (kvrouter epp) -> override-host upstream.

Used by the tests and printed by ``kvrouter envoy-config``; docs/envoy.md walks through it. The upstream
cluster lists the workers (STATIC here; EDS or an InferencePool in Kubernetes) with the ``override_host``
load-balancing policy reading the picker's ``envoy.lb`` metadata, an ordered list: a retry on connect
failure walks it (``previous_hosts`` keeps a dead host from being tried twice).

Only the OpenAI API paths (``router/frontends/api_paths.API_PATHS``, exact matches) are routed to the pool;
every other path, the engines' control paths (``/reset_prefix_cache``, ``/fault``, ``/metrics`` ...) included,
is answered 404 by Envoy itself (a ``direct_response`` route with ext_proc disabled), so neither the picker
nor a worker ever sees it.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from router.frontends.api_paths import API_PATHS

EXT_PROC = "envoy.filters.http.ext_proc"
# vLLM's error shape (router/frontends/openai.error_response), answered by Envoy for a path it does not route
NOT_FOUND_BODY = json.dumps({"object": "error", "message": "Not Found: this gateway serves only the OpenAI API "
                             "paths " + ", ".join(API_PATHS), "type": "NotFoundError", "param": None, "code": 404},
                            separators=(",", ":"))


DEFAULT_MESSAGE_TIMEOUT_S = 5.0  # an ext_proc answer without flow control: a pick takes well under a millisecond
QUEUE_ANSWER_HEADROOM_S = 2.0  # past the queue's deadline: the picker's 429 travelling back


def message_timeout(queue_timeout_s: float | None) -> str:
    """ext_proc's ``message_timeout`` (a protobuf Duration in YAML: ``"5s"``, ``"62.5s"``)."""
    seconds = DEFAULT_MESSAGE_TIMEOUT_S
    if queue_timeout_s is not None:
        if not queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0, not {queue_timeout_s!r}")
        seconds = max(seconds, queue_timeout_s + QUEUE_ANSWER_HEADROOM_S)
    return f"{seconds:g}s"


def bootstrap(*, listen_port: int, admin_port: int, picker_port: int, workers: list[str],
              body_mode: str = "FULL_DUPLEX_STREAMED", fail_open: bool = False, picker_host: str = "127.0.0.1",
              buffer_limit_bytes: int = 8 * 1024 * 1024, retries: int = 2, with_picker: bool = True,
              response_mode: str = "full", picker_streams_per_connection: int | None = None,
              queue_timeout_s: float | None = None) -> dict[str, Any]:
    """``workers``: "ip:port" of every endpoint the picker may choose (the InferencePool's members).

    ``with_picker=False``: the same Envoy without ext_proc (round robin), the baseline of ``bench epp``.
    ``response_mode``: ``full``, every response chunk through the picker (it times the first token and reads the
    usage: the engines' cached-token counts); ``headers``, the response's headers only (the lighter stream: no
    Python per chunk; the picker learns the start from the headers and the end from the stream's close).
    ``picker_streams_per_connection``: for a picker run as ``kvrouter epp --processes N``. Envoy multiplexes every
    ext_proc stream onto one HTTP/2 connection per worker thread, which lands on one process; capped, it opens
    more connections, which SO_REUSEPORT spreads over the processes.
    ``queue_timeout_s``: the picker's ``flow_control.queue_timeout_s`` where flow control is on. The picker holds
    its answer to the request's headers while the request waits in its queue, and Envoy gives up on an ext_proc
    answer after ``message_timeout`` (then fails the request, or with ``fail_open`` skips the picker): the
    timeout is made to outlast the queue's own deadline, so a held request is answered by the picker, with a 429
    and Retry-After if it waited too long, never cut off by Envoy.
    """
    if response_mode not in ("full", "headers"):
        raise ValueError(f"response_mode must be full or headers, not {response_mode!r}")
    streamed = body_mode == "FULL_DUPLEX_STREAMED"
    processing_mode: dict[str, Any] = {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": body_mode,
        "response_body_mode": body_mode if streamed and response_mode == "full" else "NONE",
    }
    if streamed:  # Envoy refuses FULL_DUPLEX_STREAMED unless trailers are sent too
        processing_mode |= {"request_trailer_mode": "SEND",
                            "response_trailer_mode": "SEND"}
    ext_proc = {
        "name": EXT_PROC,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "kvrouter_epp"}, "timeout": "10s"},
            "failure_mode_allow": fail_open,
            "processing_mode": processing_mode,
            "message_timeout": message_timeout(queue_timeout_s),
            "allow_mode_override": False,
            "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
            "response_attributes": ["upstream.address", "upstream.request_attempt_count"],
        },
    }

    def forward() -> dict[str, Any]:  # one copy per route (no YAML anchors in the printed config)
        return {
            "cluster": "inference_pool",
            "timeout": "600s",
            "retry_policy": {
                "retry_on": "connect-failure,reset-before-request",
                "num_retries": retries,
                "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                          "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                                           "retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                "host_selection_retry_max_attempts": 5,
                "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
            },
        }

    # ``path`` is an exact match on :path without its query string (``/v1/models?x=1`` matches ``/v1/models``)
    routes: list[dict[str, Any]] = [{
        "match": {"path": path},
        "route": forward(),
        "per_request_buffer_limit_bytes": buffer_limit_bytes,  # large bodies can be buffered and retried
    } for path in API_PATHS]
    not_found: dict[str, Any] = {
        "name": "not_found",
        "match": {"prefix": "/"},
        "direct_response": {"status": 404, "body": {"inline_string": NOT_FOUND_BODY}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }
    if with_picker:  # the picker never hears of a path the gateway refuses
        not_found["typed_per_filter_config"] = {EXT_PROC: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True}}
    routes.append(not_found)
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                     "HttpConnectionManager",
            "stat_prefix": "ingress",
            # routing sees the path the worker will get: dot segments resolved, "//" merged
            "normalize_path": True,
            "merge_slashes": True,
            "route_config": {"name": "local", "virtual_hosts": [{"name": "all", "domains": ["*"],
                                                                  "routes": routes}]},
            "http_filters": [ext_proc] * with_picker + [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        },
    }

    h2_options: dict[str, Any] = {}
    if picker_streams_per_connection is not None:
        if picker_streams_per_connection < 1:
            raise ValueError("picker_streams_per_connection must be at least 1")
        h2_options["max_concurrent_streams"] = picker_streams_per_connection

    def endpoints(addrs: list[str]) -> list[dict[str, Any]]:
        out = []
        for a in addrs:
            host, port = a.rsplit(":", 1)
            out.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
        return out

    pool = {
        "name": "inference_pool",
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "per_connection_buffer_limit_bytes": buffer_limit_bytes,
        "load_assignment": {"cluster_name": "inference_pool", "endpoints": [{"lb_endpoints": endpoints(workers)}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": {"key": "envoy.lb",
                                                        "path": [{"key": "x-gateway-destination-endpoint"}]}}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                                              "round_robin.v3.RoundRobin"}}}]},
            }}}]},
    }
    picker = {
        "name": "kvrouter_epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": h2_options}}},
        "load_assignment": {"cluster_name": "kvrouter_epp", "endpoints": [{"lb_endpoints": endpoints(
            [f"{picker_host}:{picker_port}"])}]},
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "inference", "per_connection_buffer_limit_bytes": buffer_limit_bytes,
                           "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                           "filter_chains": [{"filters": [hcm]}]}],
            "clusters": [pool, picker],
        },
    }


def bootstrap_yaml(**kw: Any) -> str:
    return yaml.safe_dump(bootstrap(**kw), sort_keys=False)
