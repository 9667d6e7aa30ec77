"""kvrouter.v1.Picker/Rank: the routing core's ranking for callers that are not Envoy (proto/kvrouter/v1).

An operator's tool, not a data-plane service: it answers for any ``cache_salt`` it is given how many of the
prompt's blocks each worker holds, so whoever reaches it can probe another tenant's cached prompts block by block
(issue 50, finding 4). ``kvrouter epp`` therefore serves it only when ``epp.rank_port`` is set, on its own
listener on ``admin.host`` (127.0.0.1 by default), never on the ext_proc port the gateway and the pods reach.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc

from router.frontends.openai import BadRequest
from router.gen import picker_pb2 as pb
from router.gen import picker_pb2_grpc as pb_grpc
from router.keys import request_keys
from router.scheduling import RouteRequest, RoutingCore
from router.tokenizer import PromptError, PromptTokenizer

OUTCOMES = {"routed": pb.RankResponse.ROUTED, "shed": pb.RankResponse.SHED,
            "no_endpoint": pb.RankResponse.NO_ENDPOINT}


class RankService(pb_grpc.PickerServicer):
    def __init__(self, core: RoutingCore, tokenizer_for: Callable[[str | None], PromptTokenizer],
                 block_size: int, max_model_len: Callable[[], int | None] = lambda: None) -> None:
        self.core = core
        self.tokenizer_for = tokenizer_for
        self.block_size = block_size
        self.max_model_len = max_model_len

    def tokens(self, req: pb.RankRequest) -> list[int]:
        """The prompt's token ids, checked as the HTTP front ends check them (bounded, inside the vocabulary)."""
        kind = req.WhichOneof("prompt")
        try:
            tok = self.tokenizer_for(req.model or None)
        except KeyError:
            raise BadRequest(f"The model `{req.model}` does not exist.", 404) from None
        budget = self.max_model_len()
        try:
            if kind == "text":
                return tok.encode(req.text, budget)
            if kind == "token_ids":
                return tok.check_ids(list(req.token_ids.ids), budget)
            if kind == "chat":
                return tok.encode_chat([{"role": m.role, "content": m.content} for m in req.chat.messages], budget)
        except PromptError as e:
            raise BadRequest(str(e)) from None
        raise BadRequest("one of text, token_ids or chat is required")

    async def Rank(self, request: pb.RankRequest, context: grpc.aio.ServicerContext) -> pb.RankResponse:
        try:
            ids = await asyncio.to_thread(self.tokens, request)  # tokenizing releases the GIL: off the loop
        except BadRequest as e:
            code = grpc.StatusCode.NOT_FOUND if e.status == 404 else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        keys = request_keys(ids, self.block_size, lora_name=request.lora or None,
                            cache_salt=request.cache_salt or None)
        rreq = RouteRequest(uuid.uuid4().hex, keys, len(ids), self.block_size, request.max_tokens or 16,
                            request.model or None, request.lora or None, request.session or None,
                            frozenset(request.subset) or None)
        d = self.core.decide(rreq, time.monotonic())
        order = {w: i for i, w in enumerate(d.ranked)}
        reports = sorted(d.candidates, key=lambda c: order.get(c.worker_id, len(order)))
        out = pb.RankResponse(outcome=OUTCOMES[d.outcome], reason=d.reason, policy=d.policy, prompt_tokens=len(ids))
        for c in reports:
            ep = self.core.endpoints.get(c.worker_id)
            out.endpoints.append(pb.RankedEndpoint(
                worker_id=c.worker_id, address=ep.address if ep else "", filtered=c.filtered or "",
                index_state=c.state, prefix_credit=c.prefix_credit, matched_gpu_blocks=c.matched_gpu,
                matched_cpu_blocks=c.matched_cpu, matched_storage_blocks=c.matched_storage, queue_s=c.queue_s,
                prefill_s=c.prefill_s, estimated_ttft_s=c.ttft_s, score=c.score))
        return out
