"""Workers from the Kubernetes API: the pods an InferencePool selects, watched.

Pure part (``PodSet``): folds watch events (``ADDED`` / ``MODIFIED`` / ``DELETED`` with a Pod object, as
the API server streams them) into the set of ready workers: pod IP x each target port, its KV-event
endpoint from the ``kvrouter.io/kv-events`` annotation or the port convention (vLLM's 5557, replay 5558).
A pod is a worker while it is Ready, has an IP and is not terminating; an IP change is a new endpoint.

Adapter (``KubernetesDiscovery``): reads the InferencePool (selector, targetPorts) through the official
client, lists then watches its pods from the list's resourceVersion (re-listing on 410 Gone), and hands
every change to ``Fleet.set_workers`` (which adds or drops event subscriptions with the endpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from router.discovery.static import ROLES, WorkerSpec

log = logging.getLogger(__name__)

EVENTS_ANNOTATION = "kvrouter.io/kv-events"  # e.g. "tcp://{ip}:5557" or a port number
REPLAY_ANNOTATION = "kvrouter.io/kv-replay"
TOPIC_ANNOTATION = "kvrouter.io/kv-topic"
MODEL_ANNOTATION = "kvrouter.io/models"  # comma-separated served model names
LORA_ANNOTATION = "kvrouter.io/loras"
ROLE_LABEL = "llm-d.ai/role"  # prefill | decode | both (llm-d's convention); absent: both
DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558


def _get(obj: Any, *path: str) -> Any:
    """Read a field from a dict (raw API JSON) or a client model object alike."""
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, _attr(type(obj), key), None)
    return obj


def _attr(model: type, json_name: str) -> str:
    """The client model's Python attribute for a JSON field (``podIP`` -> ``pod_ip``)."""
    for attr, name in getattr(model, "attribute_map", {}).items():
        if name == json_name:
            return attr
    return json_name


def _endpoint(value: str | None, ip: str, default_port: int | None) -> str | None:
    if value is None:
        return f"tcp://{ip}:{default_port}" if default_port else None
    value = value.strip()
    if not value or value.lower() == "none":
        return None
    if value.isdigit():
        return f"tcp://{ip}:{value}"
    return value.replace("{ip}", ip)


@dataclass
class PodSet:
    """Ready workers of one pool, folded from pod watch events. Pure."""

    target_ports: list[int]
    events_by_default: bool = True
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> pod

    def apply(self, event_type: str, pod: Any) -> bool:
        """Fold one watch event; returns whether the worker set may have changed."""
        uid = _get(pod, "metadata", "uid") or _get(pod, "metadata", "name")
        if event_type == "DELETED":
            return self.pods.pop(uid, None) is not None
        if event_type in ("ADDED", "MODIFIED"):
            self.pods[uid] = pod
            return True
        return False  # BOOKMARK, ERROR: nothing about pods

    def replace(self, pods: Iterable[Any]) -> None:
        """A fresh list (start, or after the watch expired): it is the whole truth."""
        self.pods = {(_get(p, "metadata", "uid") or _get(p, "metadata", "name")): p for p in pods}

    @staticmethod
    def ready(pod: Any) -> bool:
        if _get(pod, "metadata", "deletionTimestamp") or not _get(pod, "status", "podIP"):
            return False
        if _get(pod, "status", "phase") != "Running":
            return False
        for cond in _get(pod, "status", "conditions") or []:
            if _get(cond, "type") == "Ready":
                return _get(cond, "status") == "True"
        return False

    def workers(self) -> list[WorkerSpec]:
        out = []
        for pod in self.pods.values():
            if not self.ready(pod):
                continue
            ip = _get(pod, "status", "podIP")
            name = _get(pod, "metadata", "name")
            ann = _get(pod, "metadata", "annotations") or {}
            events = _endpoint(ann.get(EVENTS_ANNOTATION), ip, DEFAULT_EVENTS_PORT if self.events_by_default else None)
            replay = _endpoint(ann.get(REPLAY_ANNOTATION), ip, DEFAULT_REPLAY_PORT if events else None)
            models = frozenset(m.strip() for m in ann.get(MODEL_ANNOTATION, "").split(",") if m.strip())
            loras = frozenset(m.strip() for m in ann.get(LORA_ANNOTATION, "").split(",") if m.strip())
            role = (_get(pod, "metadata", "labels") or {}).get(ROLE_LABEL) or "both"
            if role not in ROLES:
                role = "both"  # an unknown role serves as an ordinary worker
            for i, port in enumerate(self.target_ports):
                wid = name if len(self.target_ports) == 1 else f"{name}:{port}"
                # one engine per target port; its events port is the pod's plus the port's index (vLLM's DP rule)
                ev = _shift(events, i)
                rp = _shift(replay, i)
                out.append(WorkerSpec(wid, f"http://{ip}:{port}", ev, rp, ann.get(TOPIC_ANNOTATION, ""), models,
                                      loras, role))
        return sorted(out, key=lambda s: s.worker_id)


def _shift(endpoint: str | None, by: int) -> str | None:
    if endpoint is None or by == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + by}" if port.isdigit() else endpoint


def pool_selector(pool: Any) -> tuple[str, list[int]]:
    """(label selector string, target ports) of an InferencePool (inference.networking.k8s.io/v1)."""
    spec = _get(pool, "spec") or {}
    labels = _get(spec, "selector", "matchLabels") or _get(spec, "selector") or {}
    if not isinstance(labels, dict) or not labels:
        raise ValueError("InferencePool has no selector.matchLabels")
    ports = [int(_get(p, "number")) for p in (_get(spec, "targetPorts") or [])]
    if not ports:
        raise ValueError("InferencePool has no targetPorts")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), ports


class KubernetesDiscovery:
    """Watch one InferencePool's pods and keep ``on_change(workers)`` informed (call from the event loop)."""

    def __init__(self, namespace: str, pool: str, on_change: Callable[[list[WorkerSpec]], None],
                 events_by_default: bool = True, kubeconfig: str | None = None) -> None:
        """``kubeconfig``: a file to use instead of the in-cluster service account."""
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.pool = pool
        self.on_change = on_change
        self.events_by_default = events_by_default
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        from kubernetes import client, config  # the official client, imported only when used

        if self.kubeconfig:
            config.load_kube_config(config_file=self.kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        custom = client.CustomObjectsApi()
        pool = await asyncio.to_thread(custom.get_namespaced_custom_object, "inference.networking.k8s.io", "v1",
                                       self.namespace, "inferencepools", self.pool)
        selector, ports = pool_selector(pool)
        podset = PodSet(ports, self.events_by_default)
        loop = asyncio.get_running_loop()
        core = client.CoreV1Api()

        def publish() -> None:
            workers = podset.workers()
            loop.call_soon_threadsafe(self.on_change, workers)

        def run() -> None:
            from kubernetes import watch
            from kubernetes.client.exceptions import ApiException

            while not self._stop.is_set():
                try:
                    listed = core.list_namespaced_pod(self.namespace, label_selector=selector)
                    podset.replace(listed.items)
                    publish()
                    w = watch.Watch()
                    for ev in w.stream(core.list_namespaced_pod, self.namespace, label_selector=selector,
                                       resource_version=listed.metadata.resource_version, timeout_seconds=300):
                        if self._stop.is_set():
                            w.stop()
                            break
                        if podset.apply(ev["type"], ev["object"]):
                            publish()
                except ApiException as e:
                    if e.status != 410:  # 410 Gone: our resourceVersion expired, list again
                        log.warning("pod watch failed: %s; retrying", e.reason)
                        self._stop.wait(2.0)
                except Exception:
                    log.exception("pod watch failed; retrying")
                    self._stop.wait(2.0)

        self._thread = threading.Thread(target=run, name="k8s-pod-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._thread.join, 1.0)
