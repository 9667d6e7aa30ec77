"""A picker that does no work, for the benches only: the ceiling of an ext_proc stream on this machine.

It answers the messages of the lighter stream as ``kvrouter epp`` does (the destination header and the
``envoy.lb`` metadata, the body sent back, the response headers let through) on the same gRPC server
(router/frontends/h2grpc.py), but picks round robin, parses nothing and keeps no state: Envoy with it in front
measures what the stream itself costs (Envoy's ext_proc filter, the gRPC messages, the hops), so the distance
from it to ``kvrouter epp`` is the picker's own work. ``python -m bench.null_picker PORT ADDR[,ADDR...]``.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from router.frontends.epp import _REQUEST_TRAILERS_GO_ON, _RESPONSE_HEADERS_GO_ON, _RESPONSE_TRAILERS_GO_ON, _routed
from router.frontends.event_loop import run
from router.frontends.h2grpc import GrpcServer


class NullPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, addresses: list[str]) -> None:
        self.next: Iterator[str] = itertools.cycle(addresses)

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest], context: Any
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        body = b""
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                body += req.request_body.body
                if req.request_body.end_of_stream:
                    yield _routed((next(self.next),))
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=body, end_of_stream=True)))))
            elif kind == "response_headers":
                yield _RESPONSE_HEADERS_GO_ON
            elif kind == "request_trailers":
                yield _REQUEST_TRAILERS_GO_ON
            elif kind == "response_trailers":
                yield _RESPONSE_TRAILERS_GO_ON


async def serve(port: int, addresses: list[str]) -> None:
    server = GrpcServer()
    pb_grpc.add_ExternalProcessorServicer_to_server(NullPicker(addresses), server)
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


if __name__ == "__main__":
    run(serve(int(sys.argv[1]), sys.argv[2].split(",")))
