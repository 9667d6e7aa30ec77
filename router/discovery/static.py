"""Workers from the command line or from a watched YAML/JSON file.

A worker entry: ``{id, url, events?, replay?, topic?, models?, loras?}``; on the command line
``URL[,events=ENDPOINT][,replay=ENDPOINT][,id=NAME][,model=NAME][,lora=NAME]``. The address (ip:port) comes from
the URL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml


class DiscoveryError(ValueError):
    pass


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    models: frozenset[str] = field(default_factory=frozenset)
    loras: frozenset[str] = field(default_factory=frozenset)
    role: str = "both"  # prefill | decode | both (prefill/decode disaggregation)

    @property
    def address(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _spec(entry: dict[str, Any], where: str) -> WorkerSpec:
    url = entry.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise DiscoveryError(f"{where}: 'url' must be an http(s) URL, got {url!r}")
    unknown = set(entry) - {"id", "url", "events", "replay", "topic", "models", "model", "loras", "lora", "role"}
    if unknown:
        raise DiscoveryError(f"{where}: unknown keys {sorted(unknown)}")
    role = entry.get("role") or "both"
    if role not in ROLES:
        raise DiscoveryError(f"{where}: 'role' must be one of {ROLES}, got {role!r}")
    models = _names(entry, "models", "model", where)
    wid = entry.get("id") or urlsplit(url).netloc
    return WorkerSpec(str(wid), url.rstrip("/"), entry.get("events"), entry.get("replay"), entry.get("topic") or "",
                      models, _names(entry, "loras", "lora", where), role)


def _names(entry: dict[str, Any], plural: str, single: str, where: str) -> frozenset[str]:
    """``models: [a, b]`` / ``model: a`` (and the same for LoRA adapters): a name given as a plain string is one
    name (``--worker URL,model=a,lora=x``), never its letters."""
    names: list[Any] = []
    for key in (plural, single):
        value = entry.get(key)
        if value is None or value == "":
            continue
        names += [value] if isinstance(value, str) else list(value) if isinstance(value, list) else [None]
    if not all(isinstance(n, str) and n for n in names):
        raise DiscoveryError(f"{where}: '{plural}' must be a list of names ('{single}': one name)")
    return frozenset(names)


def parse_worker_arg(arg: str) -> WorkerSpec:
    url, *opts = arg.split(",")
    entry: dict[str, Any] = {"url": url}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep:
            raise DiscoveryError(f"--worker {arg!r}: option {opt!r} is not key=value")
        entry[key.strip()] = value.strip()
    return _spec(entry, f"--worker {arg!r}")


def load_workers_file(path: str | Path) -> list[WorkerSpec]:
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise DiscoveryError(f"{path}: not valid YAML/JSON: {e}") from None
    entries = data.get("workers") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise DiscoveryError(f"{path}: expected a list of workers (or {{workers: [...]}})")
    specs = [_spec(e, f"{path}[{i}]") if isinstance(e, dict) else _bad(path, i) for i, e in enumerate(entries)]
    ids = [s.worker_id for s in specs]
    if len(set(ids)) != len(ids):
        raise DiscoveryError(f"{path}: duplicate worker ids")
    return specs


def _bad(path: str | Path, i: int) -> WorkerSpec:
    raise DiscoveryError(f"{path}[{i}]: each worker must be a mapping")
