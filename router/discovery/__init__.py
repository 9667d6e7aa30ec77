"""Where workers come from: static lists and watched files (Kubernetes in its own module)."""

from router.discovery.static import DiscoveryError, WorkerSpec, load_workers_file, parse_worker_arg

__all__ = ["DiscoveryError", "WorkerSpec", "load_workers_file", "parse_worker_arg"]
