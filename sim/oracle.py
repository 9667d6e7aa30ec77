"""``oracle``: the precise profile's objective evaluated on the engines' true state. Simulator only.

The ``latency-cost`` scorer (the ``precise`` profile) prices each candidate with ``CostModel.estimate`` (the
routing objective: own TTFT and decode, the stall and slowdown it brings to the requests there, the expected
re-prefill of what it evicts) from what the router knows: an event-fed index, its own in-flight accounting,
scraped metrics, each worker's fitted engine profile. The ``sim-oracle-cost`` scorer calls the same
``CostModel.estimate`` on what each engine model really holds at the instant of the decision, with no event
delay and nothing estimated from what was sent:

- prefix hit: the engine's own lookup for this prompt, ``EngineModel._hashes_upto`` (on a probe request, so
  the real one is untouched) then ``BlockPool.lookup`` (pure), exactly what ``EngineModel._admit`` will find
  now, GPU blocks then CPU-tier blocks; plus (``inflight_prefixes``) the prompt blocks that requests already
  queued or running on that engine will have computed before this one is admitted (FCFS), as the precise
  profile's speculative prefixes approximate;
- queue: the engine's waiting and running requests' real remaining prefill tokens (a waiting request's own
  true hit taken off, with the blocks other requests in flight there share);
- running requests, KV in use and the output they still have to generate: exact at the instant;
- the blocks this request adds to those in use: its prompt and output blocks but the hits that running
  requests already hold;
- eviction: the engine's real resident blocks and capacity (the reuse probability is the router's: it is a
  property of the workload, which no engine knows);
- memory wait, the engine's admission rule (``OracleParams.memory``): its prompt's blocks against the blocks free
  in the pool now, less what the prompts queued ahead of it and the running prefills still take and the
  watermark (``CostParams.kv_watermark``); when it does not fit, until enough running requests finish (at the
  engine's true decode step time), each freeing the blocks only it holds. Its output's blocks come a token at a
  time, and what decode then lacks preempts the latest request: the objective's preemption term, on the
  output the requests running there truly have still to generate;
- the engine's waiting count (the requests its prefill holds up: the objective's ``behind`` term, with the
  share of what flow control holds) and its ``max_num_seqs`` (the wait for a place in its batch);
- engine costs: each engine's own timing model and step budget (a half-speed worker is known to be one),
  nothing learned.

The simulation hands the scorer its engines (``attach_simulation``) and, per decision, the prompt being
decided (``Simulation.deciding``). The distance from ``precise`` to ``oracle`` is the price of what the live
router cannot know.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from router.index import PrefixMatch
from router.load import EngineMetrics, WorkerLoad
from router.scheduling.core import RoutingConfig
from router.scheduling.cost import CostModel, CostParams
from router.scheduling.engine_profile import StepTiming
from router.scheduling.plugins.base import Scorer
from router.scheduling.plugins.registry import REGISTRY, register
from router.scheduling.plugins.scorers.latency_cost import held_share
from router.scheduling.profiles import DEFAULT_FILTERS, parse_scheduling
from router.scheduling.snapshot import Candidate, Snapshot
from workers.engine import EngineConfig, EngineModel, EngineRequest

if TYPE_CHECKING:
    from sim.runner import Simulation

ORACLE = "oracle"  # the profile's name: a policy of the simulator only
TYPE_NAME = "sim-oracle-cost"


@dataclass(frozen=True)
class OracleParams:
    # credit the prompt blocks that requests queued or running ahead on the engine will have computed
    inflight_prefixes: bool = True
    # memory wait: "admission", the engine's own rule (its prompt's blocks must be free beside those of the
    # prompts ahead of it; decode growth is met later by preemption), or "footprint", every request's blocks to
    # its last token, as the router's in-flight accounting counts them
    memory: str = "admission"

    def __post_init__(self) -> None:
        if self.memory not in ("admission", "footprint"):
            raise ValueError(f"memory must be 'admission' or 'footprint', not {self.memory!r}")


@dataclass(slots=True)
class TrueView:
    """One engine's true state as the cost model reads it, for one prompt."""

    gpu_blocks: int  # prompt blocks hit on GPU (with what requests ahead will have computed)
    cpu_blocks: int  # further blocks in the CPU tier
    load: WorkerLoad  # requests, real remaining prefill tokens, requests decoding
    metrics: EngineMetrics  # its running count and KV in use, exact at the instant
    resident_tokens: int
    capacity_tokens: int
    memory_wait_s: float
    new_blocks: int  # the blocks this request adds to those in use there
    remaining_tokens: int  # output the requests running there have still to generate


class _Inflight:
    """The prompt block hashes of the requests queued or running on one engine, kept in step with it."""

    def __init__(self, engine: EngineModel) -> None:
        self.engine = engine
        self.members: dict[EngineRequest, list[int]] = {}
        self.count: Counter[int] = Counter()


def cost_params_for(engine: EngineConfig, base: CostParams) -> CostParams:
    """``base`` with the engine's true costs: its timing model (prefill, decode, load-back) and its scheduler's
    step token budget, nothing learned."""
    t = engine.timing
    return dataclasses.replace(base, **{f.name: getattr(t, f.name) for f in dataclasses.fields(StepTiming)},
                               step_token_budget=engine.max_num_batched_tokens, learn=False)


class OracleCost(Scorer):
    type_name = TYPE_NAME
    Params = OracleParams
    uses_prefix = False  # it never reads the router's index

    def __init__(self, params: OracleParams | None = None, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.sim: Simulation | None = None
        self._costs: dict[str, CostModel] = {}
        self._inflight: dict[str, _Inflight] = {}
        self._probe: EngineRequest | None = None  # the latest decided prompt's probe: its hashes are reused

    def attach_simulation(self, sim: Simulation) -> None:
        self.sim = sim
        self._costs.clear()
        self._inflight.clear()

    # ---- scoring -----------------------------------------------------------------------------------
    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        sim = self.sim
        if sim is None or sim.deciding is None:
            raise RuntimeError(f"{TYPE_NAME} scores simulated requests only (Simulation.decide)")
        r, tokens = sim.deciding
        req = snap.request
        if req.request_id != r.request_id and not req.request_id.startswith(r.request_id + ":"):  # or its prefill
            raise RuntimeError(f"{TYPE_NAME}: deciding {req.request_id}, the simulation says {r.request_id}")
        bs = req.block_size
        hashes = self.prompt_hashes(r.request_id, tokens, req.max_tokens)
        views = [self.true_view(c.worker_id, hashes, len(tokens), req.max_tokens, snap.costs.params.kv_watermark)
                 for c in cands]
        held = held_share(snap)
        out = []
        for c, v in zip(cands, views, strict=True):
            cost = self._cost(c.worker_id, snap.costs.params)
            est = cost.estimate(c.worker_id, len(tokens), bs, PrefixMatch(v.gpu_blocks, v.cpu_blocks), v.load,
                                v.metrics, max_tokens=req.max_tokens, new_blocks=v.new_blocks,
                                resident_tokens=v.resident_tokens, capacity_tokens=v.capacity_tokens,
                                memory_wait_s=v.memory_wait_s, reuse=snap.reuse, remaining_tokens=v.remaining_tokens,
                                held_share=held)
            c.matched_gpu, c.matched_cpu, c.matched_storage, c.speculative = v.gpu_blocks, v.cpu_blocks, 0, 0
            c.queue_s, c.prefill_s, c.decode_s, c.ttft_s = est.queue_s, est.prefill_s, est.decode_s, est.ttft_s
            c.interference_s, c.eviction_s, c.step_s = est.interference_s, est.eviction_s, est.step_s
            c.behind_s, c.preempt_s = est.behind_s, est.preempt_s
            out.append(est.score)
        return out

    def _cost(self, worker_id: str, base: CostParams) -> CostModel:
        cost = self._costs.get(worker_id)
        if cost is None:
            assert self.sim is not None
            cost = self._costs[worker_id] = CostModel(cost_params_for(self.sim.engine_configs[worker_id], base))
        return cost

    # ---- the engines' true state ----------------------------------------------------------------------
    def prompt_hashes(self, request_id: str, tokens: np.ndarray, max_tokens: int) -> list[int]:
        """The engine's block hashes of the blocks a lookup may hit, as ``EngineModel._admit`` computes them
        (on a probe: the engine and its requests are not touched). Every engine of a simulation hashes alike."""
        assert self.sim is not None
        engine = next(iter(self.sim.engines.values()))
        probe = EngineRequest(request_id, tokens, max_tokens)
        self._probe = probe  # it is added to an engine next: its hashes are tracked from there
        return list(engine._hashes_upto(probe, (probe.num_tokens - 1) // engine.config.block_size))

    def true_view(self, worker_id: str, hashes: Sequence[int], prompt_tokens: int, max_tokens: int,
                  watermark: float = 0.0) -> TrueView:
        assert self.sim is not None
        engine = self.sim.engines[worker_id]
        pool, bs = engine.pool, engine.config.block_size
        gpu_ids, cpu_hits = pool.lookup(hashes)  # what the engine would find cached for this prompt now
        gpu = len(gpu_ids)
        track = self._track(worker_id, engine)
        if self.params.inflight_prefixes and gpu < len(hashes) and hashes[gpu] in track.count:
            while gpu < len(hashes) and (hashes[gpu] in track.count or hashes[gpu] in pool.cached):
                gpu += 1
            cpu_hits = 0
            cpu = pool.cpu
            while gpu + cpu_hits < len(hashes) and hashes[gpu + cpu_hits] in cpu:
                cpu_hits += 1
        # the requests there: real remaining prefill, and the blocks they take before this one is admitted
        footprint = self.params.memory == "footprint"
        pending = 0
        ahead = 0
        for q in engine.running:
            if not q.n_out:
                pending += max(0, q.num_tokens - q.num_computed)
            end = q.prompt_len + q.max_tokens if footprint else q.num_tokens
            ahead += max(0, -(-end // bs) - len(q.block_ids))
        cached, count = pool.cached, track.count
        for q in engine.waiting:
            qh = track.members.get(q) or ()
            limit = min(len(qh), (q.num_tokens - 1) // bs)
            hit = 0
            while hit < limit and (qh[hit] in cached or count[qh[hit]] >= 2):
                hit += 1
            pending += q.num_tokens - min(hit * bs, q.num_tokens - 1)
            ahead += max(0, -(-(q.prompt_len + q.max_tokens if footprint else q.num_tokens) // bs) - hit)
        # the decode term counts the engine's running requests, as precise reads vllm:num_requests_running; the
        # batch wait takes a place freeing once per request's decode (their mean max_tokens)
        load = WorkerLoad(requests=len(engine.running) + len(engine.waiting), pending_prefill_tokens=pending,
                          decoding=len(engine.running),
                          output_tokens=sum(q.max_tokens for q in engine.running) + sum(
                              q.max_tokens for q in engine.waiting))
        need = -(-(prompt_tokens + (max_tokens if footprint else 0)) // bs) - gpu
        room = pool.num_free - ahead - watermark * pool.num_blocks
        wait = 0.0 if need <= room else self._release_wait(engine, need - room, footprint)
        remaining = sum(q.max_tokens - q.n_out for q in engine.running)
        metrics = EngineMetrics(len(engine.waiting), len(engine.running), pool.usage, 0.0,
                                batch_limit=engine.config.max_num_seqs)
        in_use = sum(1 for b in gpu_ids if pool.blocks[b].ref_cnt > 0)  # hits shared with requests running there
        new_blocks = max(0, -(-(prompt_tokens + max_tokens) // bs) - in_use)
        return TrueView(gpu, cpu_hits, load, metrics, len(pool.cached) * bs, pool.num_blocks * bs, wait, new_blocks,
                        remaining)

    def _release_wait(self, engine: EngineModel, blocks: int, footprint: bool) -> float:
        """Until running requests finish (at the engine's decode step now) and free ``blocks``: each frees the
        blocks only it holds (and, counting footprints, the growth it no longer needs). All of them not enough:
        the last one's end."""
        pool, bs = engine.pool, engine.config.block_size
        step_s = engine.timing.decode_ms(pool.usage) / 1000
        ends = []
        for q in engine.running:
            own = sum(1 for b in q.block_ids if pool.blocks[b].ref_cnt == 1)
            if footprint:
                own += max(0, -(-(q.prompt_len + q.max_tokens) // bs) - len(q.block_ids))
            ends.append(((q.max_tokens - q.n_out) * step_s, own))
        if not ends:
            return 0.0
        ends.sort()
        freed = 0
        for end, n in ends:
            freed += n
            if freed >= blocks:
                return end
        return ends[-1][0]

    def _track(self, worker_id: str, engine: EngineModel) -> _Inflight:
        track = self._inflight.get(worker_id)
        if track is None or track.engine is not engine:  # first look, or the engine restarted
            track = self._inflight[worker_id] = _Inflight(engine)
        now = set(engine.running)
        now.update(engine.waiting)
        members, count = track.members, track.count
        for q in [q for q in members if q not in now]:
            for h in members.pop(q):
                left = count[h] - 1
                if left:
                    count[h] = left
                else:
                    del count[h]
        bs = engine.config.block_size
        for q in now:
            if q in members:
                continue
            probe = self._probe
            if probe is None or probe.request_id != q.request_id:
                probe = EngineRequest(q.request_id, q.prompt, q.max_tokens)
            members[q] = hs = list(engine._hashes_upto(probe, q.prompt_len // bs))  # full prompt blocks
            count.update(hs)
        return track


if TYPE_NAME not in REGISTRY:
    register(OracleCost)


def oracle_scheduling(max_inflight_requests: int | None = 512, max_inflight_tokens: int | None = None,
                      params: dict[str, Any] | None = None) -> Any:
    """A ``scheduling`` config whose profile ``oracle`` is the built-in filters (the same admission limits as
    the built-in profiles), the oracle scorer and min-score."""
    filters: list[Any] = [f for f in DEFAULT_FILTERS if f != "admission"]
    limits = {"max_inflight_requests": max_inflight_requests, "max_inflight_tokens": max_inflight_tokens}
    return parse_scheduling({
        "version": 1,
        "plugins": [
            {"type": "admission", "name": "oracle-admission", "parameters": limits},
            {"type": TYPE_NAME, "name": "oracle-cost", "parameters": dict(params or {})},
        ],
        "profiles": [{"name": ORACLE, "plugins": [*filters, "oracle-admission", "oracle-cost", "min-score"]}],
    })


def sim_routing(policy: str, block_size: int, seed: int | None = None, **fields: Any) -> RoutingConfig:
    """The routing config a simulation of ``policy`` runs (``fields``: more RoutingConfig fields, a cost or a
    disaggregation): a built-in or configured profile, or the simulator's own ``oracle``."""
    if policy == ORACLE:
        return oracle_routing(block_size, seed, RoutingConfig(block_size=block_size, seed=seed, **fields))
    return RoutingConfig(policy=policy, block_size=block_size, seed=seed, **fields)


def oracle_routing(block_size: int, seed: int | None = None, base: RoutingConfig | None = None,
                   **params: Any) -> RoutingConfig:
    """``base`` (or the defaults) with policy ``oracle``: what ``Simulation`` builds for ``policy="oracle"``."""
    base = base or RoutingConfig(block_size=block_size, seed=seed)
    sched = oracle_scheduling(base.max_inflight_requests, base.max_inflight_tokens, params)
    return dataclasses.replace(base, policy=ORACLE, block_size=block_size, seed=seed, scheduling=sched)
