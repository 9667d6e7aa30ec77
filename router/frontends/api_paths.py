"""The HTTP paths kvrouter serves: the OpenAI API and vLLM's tokenizer paths, nothing else.

Engines serve control paths beside the API (vLLM's ``/reset_prefix_cache``, ``/sleep``, ``/collective_rpc``,
the simulated worker's ``/fault``). A gateway in front of them must never let a client reach those, so the
proxy's routes, the endpoint picker and the generated Envoy config all read this one list.

``/tokenize`` and ``/detokenize`` are answered by the router itself, with its own tokenizer (the proxy as a
handler, the endpoint picker as an ImmediateResponse): no worker is contacted for them.
"""

from __future__ import annotations

# POST paths whose body is a prompt: tokenized, keyed and routed by prefix
GENERATE_PATHS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
# paths with no prompt to route on (any ready worker answers)
BODYLESS_PATHS: tuple[str, ...] = ("/v1/models",)
# POST paths the router answers itself, from its own tokenizer (vLLM's request and answer shapes)
TOKENIZER_PATHS: tuple[str, ...] = ("/tokenize", "/detokenize")
API_PATHS: tuple[str, ...] = GENERATE_PATHS + BODYLESS_PATHS + TOKENIZER_PATHS


def api_path(path: str) -> str:
    """``path`` without its query string and trailing slash: what the lists above hold."""
    return path.split("?", 1)[0].rstrip("/")


def is_api_path(path: str) -> bool:
    """``path`` without its query string: exactly one of the API paths (a trailing slash tolerated)."""
    return api_path(path) in API_PATHS
