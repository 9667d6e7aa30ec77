"""Scheduling profiles: filters + weighted scorers + one picker, built from config.

The config section (``scheduling:`` in the router's YAML, versioned) declares plugin instances and profiles,
in the shape llm-d's EndpointPickerConfig made familiar::

    scheduling:
      version: 1
      imports: [my_scorers.py]            # files or modules that register plugin types
      plugins:
        - {type: approx-prefix, name: tight-tree, parameters: {match_threshold: 0.8}}
      profiles:
        - name: tight
          plugins: [{ref: healthy}, {ref: tight-tree, weight: 1.0}, {ref: min-score}]
    routing: {policy: tight}

A ref names a declared plugin, or a registered type used with its defaults. Every built-in policy
(``random``, ``round_robin``, ``least_loaded``, ``session_hash``, ``approx_prefix``, ``precise``) is a
built-in profile written the same way. Errors name the key.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from router.scheduling.plugins.base import Filter, Picker, Plugin, Scorer
from router.scheduling.plugins.registry import REGISTRY, import_plugins

VERSION = 1
DEFAULT_FILTERS = ("healthy", "not-draining", "in-subset", "serves-model", "admission")


@dataclass(frozen=True)
class PluginSpec:
    type: str
    name: str | None = None  # how profiles refer to it (default: its type)
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PluginRef:
    ref: str
    weight: float = 1.0  # scorers only


@dataclass(frozen=True)
class ProfileSpec:
    name: str
    plugins: tuple[PluginRef, ...]


@dataclass(frozen=True)
class SchedulingConfig:
    version: int = VERSION
    imports: tuple[str, ...] = ()
    plugins: tuple[PluginSpec, ...] = ()
    profiles: tuple[ProfileSpec, ...] = ()


@dataclass
class Profile:
    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker

    @property
    def uses_prefix(self) -> bool:
        return any(s.uses_prefix for s, _ in self.scorers)

    @property
    def plugins(self) -> list[Plugin]:
        return [*self.filters, *(s for s, _ in self.scorers), self.picker]


class ProfileError(ValueError):
    pass


# ---- parsing ------------------------------------------------------------------------------------------
def _mapping(value: Any, where: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}: expected a mapping, got {value!r}")
    unknown = set(value) - known
    if unknown:
        raise ProfileError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProfileError(f"{where}: expected a list, got {value!r}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def parse_scheduling(data: Any, where: str = "scheduling") -> SchedulingConfig:
    """The ``scheduling:`` section as written in YAML, checked key by key."""
    if data is None:
        return SchedulingConfig()
    if isinstance(data, SchedulingConfig):
        return data
    d = _mapping(data, where, {"version", "imports", "plugins", "profiles"})
    version = d.get("version", VERSION)
    if version != VERSION:
        raise ProfileError(f"{where}.version: only version {VERSION} is known, got {version!r}")
    imports = tuple(_str(v, f"{where}.imports[{i}]") for i, v in enumerate(_list(d.get("imports", []),
                                                                                   f"{where}.imports")))
    plugins = []
    for i, p in enumerate(_list(d.get("plugins", []), f"{where}.plugins")):
        w = f"{where}.plugins[{i}]"
        p = _mapping(p, w, {"type", "name", "parameters"})
        params = p.get("parameters") or {}
        _mapping(params, f"{w}.parameters", set(params) if isinstance(params, dict) else set())
        plugins.append(PluginSpec(_str(p.get("type"), f"{w}.type"),
                                  _str(p["name"], f"{w}.name") if "name" in p else None, dict(params)))
    profiles = []
    for i, prof in enumerate(_list(d.get("profiles", []), f"{where}.profiles")):
        w = f"{where}.profiles[{i}]"
        prof = _mapping(prof, w, {"name", "plugins"})
        refs = []
        for j, r in enumerate(_list(prof.get("plugins"), f"{w}.plugins")):
            rw = f"{w}.plugins[{j}]"
            if isinstance(r, str):
                r = {"ref": r}
            r = _mapping(r, rw, {"ref", "weight"})
            weight = r.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise ProfileError(f"{rw}.weight: expected a number, got {weight!r}")
            refs.append(PluginRef(_str(r.get("ref"), f"{rw}.ref"), float(weight)))
        profiles.append(ProfileSpec(_str(prof.get("name"), f"{w}.name"), tuple(refs)))
    return SchedulingConfig(version, imports, tuple(plugins), tuple(profiles))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise ProfileError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def make_params(cls: type[Plugin], parameters: dict[str, Any], where: str) -> Any:
    """A plugin's typed parameters from a mapping: unknown names and wrong types are errors naming the key."""
    hints = typing.get_type_hints(cls.Params)
    names = {f.name for f in dataclasses.fields(cls.Params)}
    unknown = set(parameters) - names
    if unknown:
        raise ProfileError(f"{where}: unknown parameters {sorted(unknown)} for {cls.type_name}; "
                           f"known: {sorted(names)}")
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in parameters.items()}
    try:
        return cls.Params(**values)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {e}") from None


# ---- building -----------------------------------------------------------------------------------------
def builtin_profiles(max_inflight_requests: int | None = 512, max_inflight_tokens: int | None = None,
                     approx_capacity_blocks: int = 2_000_000) -> dict[str, list[tuple[str, dict[str, Any], float]]]:
    """Today's six policies, then the peers' algorithms, as profiles: (plugin type, parameters, weight) each,
    filters first."""
    filters: list[tuple[str, dict[str, Any], float]] = [(f, {}, 1.0) for f in DEFAULT_FILTERS]
    filters[-1] = ("admission", {"max_inflight_requests": max_inflight_requests,
                                 "max_inflight_tokens": max_inflight_tokens}, 1.0)
    return {
        "random": [*filters, ("random", {}, 1.0)],
        "round_robin": [*filters, ("round-robin", {}, 1.0)],
        "least_loaded": [*filters, ("load", {}, 1.0), ("min-score", {}, 1.0)],
        "session_hash": [*filters, ("session-hash", {}, 1.0)],
        "approx_prefix": [*filters, ("approx-prefix", {"capacity_blocks": approx_capacity_blocks}, 1.0),
                          ("min-score", {}, 1.0)],
        # meets-objective: min-score for a request without targets; to its targets on the scorer's predictions
        "precise": [*filters, ("latency-cost", {}, 1.0), ("meets-objective", {}, 1.0)],
        # the same objective, TTFT first: the decode time the KV load decides is not counted
        "precise_ttft": [*filters, ("latency-cost", {"kv_load_weight": 0.0}, 1.0), ("meets-objective", {}, 1.0)],
        # the peers' algorithms as their public code and docs describe them (docs/plugins.md, "Peer profiles")
        "llmd": [*filters, ("llmd-precise-prefix", {}, 2.0), ("llmd-queue", {}, 1.0),
                 ("llmd-kv-utilization", {}, 1.0), ("llmd-lora-affinity", {}, 1.0), ("min-score", {}, 1.0)],
        # llm-d's predicted-latency routing: its SLO headroom rule on its own kind of predictors (gradient-boosted
        # trees trained online), the latency scorer's predictions until they have learned
        "llmd_predicted": [*filters, ("latency-cost", {}, 1.0), ("llmd-latency-predictor", {}, 1.0),
                           ("llmd-headroom", {}, 1.0)],
        "llmd_affinity": [*filters, ("llmd-prefix-affinity", {}, 1.0), ("llmd-token-load", {}, 1.0),
                          ("llmd-lora-affinity", {}, 1.0), ("min-score", {}, 1.0)],
        "dynamo": [*filters, ("dynamo-cost", {}, 1.0), ("softmax", {"temperature": 0.0}, 1.0)],
        "aibrix": [*filters, ("aibrix-prefix-cache", {}, 1.0), ("min-score", {}, 1.0)],
        "sglang": [*filters, ("approx-prefix", {"capacity_blocks": approx_capacity_blocks}, 1.0),
                   ("min-score", {}, 1.0)],  # SGLang cache_aware's thresholds: the approx-prefix defaults
        "preble": [*filters, ("preble-e2", {}, 1.0), ("min-score", {}, 1.0)],
    }


BUILTIN_PROFILES = tuple(builtin_profiles())


def profile_names(config: SchedulingConfig) -> list[str]:
    return [*BUILTIN_PROFILES, *(p.name for p in config.profiles)]


def _assemble(name: str, plugins: list[tuple[Plugin, float]], where: str) -> Profile:
    filters = [p for p, _ in plugins if isinstance(p, Filter)]
    scorers = [(p, w) for p, w in plugins if isinstance(p, Scorer)]
    pickers = [p for p, _ in plugins if isinstance(p, Picker)]
    if len(pickers) > 1:
        raise ProfileError(f"{where}: a profile has one picker, {name!r} has {len(pickers)}")
    picker = pickers[0] if pickers else REGISTRY["min-score"]()  # as llm-d: no picker named, the best score
    return Profile(name, filters, scorers, picker)


def build_profile(name: str, config: SchedulingConfig, rng: random.Random,
                  builtin: dict[str, list[tuple[str, dict[str, Any], float]]] | None = None) -> Profile:
    """Instantiate profile ``name`` (built-in or from ``config``); every plugin shares ``rng`` (seeded ties)."""
    for source in config.imports:
        import_plugins(source)
    builtin = builtin if builtin is not None else builtin_profiles()
    custom = {p.name: p for p in config.profiles}
    if name in custom:
        i = next(i for i, p in enumerate(config.profiles) if p.name == name)
        where = f"scheduling.profiles[{i}]"
        declared = {(s.name or s.type): (k, s) for k, s in enumerate(config.plugins)}
        plugins: list[tuple[Plugin, float]] = []
        for j, ref in enumerate(custom[name].plugins):
            rw = f"{where}.plugins[{j}].ref"
            if ref.ref in declared:
                k, spec = declared[ref.ref]
                cls = REGISTRY.get(spec.type)
                if cls is None:
                    raise ProfileError(f"scheduling.plugins[{k}].type: unknown plugin type {spec.type!r}; "
                                       f"known: {sorted(REGISTRY)}")
                params = make_params(cls, spec.parameters, f"scheduling.plugins[{k}].parameters")
            elif ref.ref in REGISTRY:
                cls, params = REGISTRY[ref.ref], None
            else:
                raise ProfileError(f"{rw}: unknown plugin {ref.ref!r}; declared: {sorted(declared)}, "
                                   f"types: {sorted(REGISTRY)}")
            plugins.append((cls(params, rng=rng), ref.weight))
        return _assemble(name, plugins, where)
    if name in builtin:
        plugins = []
        for type_name, parameters, weight in builtin[name]:
            cls = REGISTRY[type_name]
            plugins.append((cls(make_params(cls, parameters, f"profile {name}"), rng=rng), weight))
        return _assemble(name, plugins, f"profile {name}")
    raise ProfileError(f"unknown policy {name!r}; choose from {profile_names(config)}")


def describe(config: SchedulingConfig | None = None) -> dict[str, Any]:
    """Every registered plugin with its parameters, and every profile (``kvrouter plugins --json``)."""
    from router.scheduling.plugins.base import params_doc

    config = config or SchedulingConfig()
    for source in config.imports:
        import_plugins(source)
    out: dict[str, Any] = {"filters": [], "scorers": [], "pickers": [], "profiles": {}}
    for type_name, cls in sorted(REGISTRY.items()):
        module = sys.modules.get(cls.__module__)
        entry = {"type": type_name, "parameters": params_doc(cls), "doc": ((module and module.__doc__) or "").strip()}
        if cls.kind == "scorer":
            entry["uses_prefix"] = cls.uses_prefix  # type: ignore[attr-defined]
        out[cls.kind + "s"].append(entry)
    for name, plugins in builtin_profiles().items():
        out["profiles"][name] = {"builtin": True, "plugins": [
            {"type": t, "parameters": p, **({"weight": w} if REGISTRY[t].kind == "scorer" else {})}
            for t, p, w in plugins]}
    declared = {(s.name or s.type): s for s in config.plugins}
    for prof in config.profiles:
        out["profiles"][prof.name] = {"builtin": False, "plugins": [
            {"ref": r.ref, "type": declared[r.ref].type if r.ref in declared else r.ref,
             "parameters": declared[r.ref].parameters if r.ref in declared else {}, "weight": r.weight}
            for r in prof.plugins]}
    return out
