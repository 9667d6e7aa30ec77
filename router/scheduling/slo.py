"""Per-request service objectives: TTFT and TPOT targets and a priority, and whether a finished request met them.

Where they come from, in the peers' vocabulary so their clients work unchanged:
- llm-d's predicted-latency routing reads the targets from ``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms``
  (its earlier releases: ``x-slo-ttft-ms``, ``x-slo-tpot-ms``; both are read, the newer first);
- the Gateway API Inference Extension names an InferenceObjective in ``x-gateway-inference-objective`` (llm-d's
  router: ``x-llm-d-inference-objective``); the objective (here: ``slo.objectives`` in config) carries the
  priority, negative meaning sheddable;
- their flow control's fairness id (``x-llm-d-inference-fairness-id``, ``x-gateway-inference-fairness-id``) names
  the flow a request waits in, unless a trusted tenant header is configured: then the tenant is the flow
  (``flow_id``), so a client cannot claim more flows, and more of the fleet, than it has;
- config gives defaults per model and per tenant (``slo.models``, ``slo.tenants``), so a platform team can state
  an objective for traffic whose clients send nothing.

A client may only lower what config gives it, never raise it: priority decides who is shed first and who waits,
so it comes only from the operator's config. The objective config gives a request (its tenant's, else its
model's, else ``slo.default``) caps what the objective header may name: an objective of equal or lower priority,
a higher one being refused (``ObjectiveForbidden``, a 403: the client is told, not silently served at another
priority than it named; a request no config covers may name any objective, as GIE's clients do). A target header
may tighten the objective's targets, never loosen them (a looser target would have flow control hold the request
later and the picker shed it later than the operator's objective says). A request without any objective keeps the
router's behaviour exactly: ``ServiceObjective()`` has no targets.

Attainment follows DistServe and Mooncake: a request meets its objective when its TTFT and its TPOT (the mean
time per output token after the first) are both within target; a missing target is met; a request that was shed,
refused or failed meets nothing. Goodput is the rate of requests that met theirs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")  # llm-d's, newer first
TPOT_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")  # llm-d's, GIE's
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
OBJECTIVE_HEADER_NAMES = frozenset(TTFT_HEADERS + TPOT_HEADERS + OBJECTIVE_HEADERS + FAIRNESS_HEADERS)
MAX_TARGET_MS = 24 * 3600 * 1000.0  # a target longer than a day is a client's mistake, not an objective
# a target shorter than a microsecond is no objective either; the bound keeps the target a normal float (5e-324 ms
# was 0.0 s, a division by zero where a prediction is compared with it), not a judgement of what can be met
MIN_TARGET_MS = 0.001
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")  # milliseconds as written: no sign, exponent or underscore


class ObjectiveError(ValueError):
    """A request's objective headers cannot be read: the client gets a 400 naming the header."""


class ObjectiveForbidden(ObjectiveError):
    """The objective header names a higher priority than config gives the request: the client gets a 403."""


@dataclass(frozen=True, slots=True)
class ServiceObjective:
    """What one request needs. ``None`` targets: none stated. ``priority``: GIE's (higher first, < 0 sheddable)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    priority: int = 0
    name: str | None = None  # the configured objective it came from, for metrics and /debug/decision
    # where the request's own target headers changed the targets: the objective config gave it. Flow control
    # holds such a request whenever either would be held, so a stated target can make it wait earlier, never
    # later, than the operator's rule for it (a day-long or hopeless target must not skip the queue)
    configured: ServiceObjective | None = None

    @property
    def has_targets(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a request served with ``ttft_s`` and ``tpot_s`` met this objective (None ``ttft_s``: it never
        produced a token; None ``tpot_s``: one output token, so no TPOT to miss)."""
        if ttft_s is None:
            return False
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


NO_OBJECTIVE = ServiceObjective()


@dataclass(frozen=True)
class SloConfig:
    """``slo:`` in the router's config: named objectives, and which one a model's or a tenant's requests get
    when they name none (the tenant's default wins over the model's: it is the more specific promise)."""

    objectives: Mapping[str, ServiceObjective] = field(default_factory=dict)
    models: Mapping[str, str] = field(default_factory=dict)  # model -> objective name
    tenants: Mapping[str, str] = field(default_factory=dict)  # tenant -> objective name
    default: str | None = None  # the objective of a request nothing else names

    def __post_init__(self) -> None:
        for where, table in (("slo.models", self.models), ("slo.tenants", self.tenants)):
            for key, name in table.items():
                if name not in self.objectives:
                    raise ObjectiveError(f"{where}.{key}: no objective named {name!r} in slo.objectives")
        if self.default is not None and self.default not in self.objectives:
            raise ObjectiveError(f"slo.default: no objective named {self.default!r} in slo.objectives")


def parse_target_ms(header: str, text: str) -> float:
    """A target header's milliseconds as seconds; ObjectiveError for anything but a plain decimal number (digits,
    an optional fraction: Python's ``float`` would also take ``1_000``, ``1e3``, ``inf``, ``+5``) from
    ``MIN_TARGET_MS`` to ``MAX_TARGET_MS``."""
    shown = text[:40]
    text = text.strip()
    if not _DECIMAL.fullmatch(text):
        raise ObjectiveError(f"{header}: expected milliseconds as a plain decimal number, got {shown!r}")
    ms = float(text)
    if not MIN_TARGET_MS <= ms <= MAX_TARGET_MS:
        raise ObjectiveError(f"{header}: expected milliseconds from {MIN_TARGET_MS:g} to {MAX_TARGET_MS:.0f}, "
                             f"got {shown!r}")
    return ms / 1000.0


def _header(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str | None]:
    """The first of ``names`` the request carries, and its value (the last name and None: none)."""
    for name in names:
        value = headers.get(name)
        if value is not None:
            return name, value
    return names[-1], None


def flow_id(headers: Mapping[str, str], tenant: str | None) -> str | None:
    """The flow a held request waits in (fairness between flows): the trusted tenant when there is one, else the
    fairness id the request names (GIE's and llm-d's header), else none."""
    return tenant if tenant is not None else _header(headers, FAIRNESS_HEADERS)[1]


def configured_objective(config: SloConfig, model: str | None = None, tenant: str | None = None) -> str | None:
    """The objective config gives a request: its tenant's, else its model's, else the default (None: none)."""
    if tenant is not None and tenant in config.tenants:
        return config.tenants[tenant]
    if model is not None and model in config.models:
        return config.models[model]
    return config.default


def objective_for(headers: Mapping[str, str], config: SloConfig, model: str | None = None,
                  tenant: str | None = None) -> ServiceObjective:
    """The objective of one request: the one config gives it (``configured_objective``), or the one the objective
    header names, which may not be of higher priority than that (``ObjectiveForbidden``); then the request's own
    target headers, each the tighter of itself and that objective's target. ``headers``' keys are lower-case (or
    a case-insensitive mapping). An unknown objective name is an ObjectiveError (a 400): a typo must not silently
    drop a request to the default priority."""
    configured = configured_objective(config, model, tenant)
    header, name = _header(headers, OBJECTIVE_HEADERS)
    if name is not None:
        name = name.strip()
        if name not in config.objectives:
            raise ObjectiveError(f"{header}: no objective named {name[:80]!r}")
        cap = config.objectives[configured] if configured is not None else None
        if cap is not None and config.objectives[name].priority > cap.priority:
            raise ObjectiveForbidden(
                f"{header}: objective {name!r} (priority {config.objectives[name].priority}) is above this "
                f"request's configured objective {configured!r} (priority {cap.priority}); a request may name "
                f"only an objective of equal or lower priority")
    else:
        name = configured
    base = config.objectives[name] if name is not None else NO_OBJECTIVE
    (ttft_header, ttft), (tpot_header, tpot) = _header(headers, TTFT_HEADERS), _header(headers, TPOT_HEADERS)
    if ttft is None and tpot is None:
        return base
    return ServiceObjective(_tighter(parse_target_ms(ttft_header, ttft), base.ttft_s) if ttft is not None
                            else base.ttft_s,
                            _tighter(parse_target_ms(tpot_header, tpot), base.tpot_s) if tpot is not None
                            else base.tpot_s,
                            base.priority, base.name, base)


def _tighter(stated: float, configured: float | None) -> float:
    """A client's target against the objective's: the tighter one (a request met within it met the other)."""
    return stated if configured is None else min(stated, configured)


def parse_slo_config(raw: Mapping[str, object] | None) -> SloConfig:
    """``slo:`` from YAML: ``objectives: {NAME: {priority: P, ttft_ms: T, tpot_ms: U}}``, ``models: {MODEL:
    NAME}``, ``tenants: {TENANT: NAME}``, ``default: NAME``. ObjectiveError names the bad key."""
    if not raw:
        return SloConfig()
    unknown = set(raw) - {"objectives", "models", "tenants", "default"}
    if unknown:
        raise ObjectiveError(f"slo: unknown key {sorted(unknown)[0]!r}")
    objectives: dict[str, ServiceObjective] = {}
    for name, spec in dict(raw.get("objectives") or {}).items():  # type: ignore[call-overload]
        where = f"slo.objectives.{name}"
        if not isinstance(spec, Mapping):
            raise ObjectiveError(f"{where}: expected a mapping")
        bad = set(spec) - {"priority", "ttft_ms", "tpot_ms"}
        if bad:
            raise ObjectiveError(f"{where}: unknown key {sorted(bad)[0]!r}")
        priority = spec.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ObjectiveError(f"{where}.priority: expected an integer, got {priority!r}")
        targets = [None if spec.get(k) is None else parse_target_ms(f"{where}.{k}", str(spec[k]))
                   for k in ("ttft_ms", "tpot_ms")]
        objectives[str(name)] = ServiceObjective(targets[0], targets[1], priority, str(name))
    tables = {}
    for key in ("models", "tenants"):
        table = raw.get(key) or {}
        if not isinstance(table, Mapping):
            raise ObjectiveError(f"slo.{key}: expected a mapping")
        tables[key] = {str(k): str(v) for k, v in table.items()}
    default = raw.get("default")
    return SloConfig(objectives, tables["models"], tables["tenants"], None if default is None else str(default))


__all__ = ["FAIRNESS_HEADERS", "MIN_TARGET_MS", "NO_OBJECTIVE", "OBJECTIVE_HEADERS", "OBJECTIVE_HEADER_NAMES",
           "TPOT_HEADERS", "TTFT_HEADERS", "ObjectiveError", "ObjectiveForbidden", "ServiceObjective", "SloConfig",
           "configured_objective", "flow_id", "objective_for", "parse_slo_config", "parse_target_ms"]
