"""The HTTP paths that may reach a worker through kvrouter: the OpenAI API, nothing else.

Engines serve control paths beside the API (vLLM's ``/reset_prefix_cache``, ``/sleep``, ``/collective_rpc``,
the simulated worker's ``/fault``). A gateway in front of them must never let a client reach those, so the
proxy's routes, the endpoint picker and the generated Envoy config all read this one list.
"""

from __future__ import annotations

# POST paths whose body is a prompt: tokenized, keyed and routed by prefix
GENERATE_PATHS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")
# paths with no prompt to route on (any ready worker answers)
BODYLESS_PATHS: tuple[str, ...] = ("/v1/models",)
API_PATHS: tuple[str, ...] = GENERATE_PATHS + BODYLESS_PATHS


def is_api_path(path: str) -> bool:
    """``path`` without its query string: exactly one of the API paths (a trailing slash tolerated)."""
    return path.split("?", 1)[0].rstrip("/") in API_PATHS
