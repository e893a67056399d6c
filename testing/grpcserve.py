"""gRPC servers built from the service descriptors, for the simulator (FakeKubelet, FakeDevicePlugin).

The sidecar only dials; nothing in production serves gRPC, so these live beside the simulator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import method_path, serialize

Resp = TypeVar("Resp", bound=Message)


def server_stream(
    channel: grpc.aio.Channel, service: Any, method: str, response: type[Resp]
) -> grpc.aio.UnaryStreamMultiCallable[Message, Resp]:
    return channel.unary_stream(
        method_path(service, method),
        request_serializer=serialize,
        response_deserializer=response.FromString,
    )


UnaryBehaviour = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]
StreamBehaviour = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Message]]


def service_handler(
    service: Any,
    unaries: Mapping[str, UnaryBehaviour],
    streams: Mapping[str, StreamBehaviour] | None = None,
) -> grpc.GenericRpcHandler:
    """A generic handler serving the named methods of a service descriptor."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for name, behaviour in unaries.items():
        method = service.methods_by_name[name]
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=_message_class(method.input_type).FromString,
            response_serializer=serialize,
        )
    for name, stream in (streams or {}).items():
        method = service.methods_by_name[name]
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=_message_class(method.input_type).FromString,
            response_serializer=serialize,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _message_class(descriptor: Any) -> type[Message]:
    module = dp if descriptor.file is dp.DESCRIPTOR else pr
    cls: type[Message] = getattr(module, descriptor.name)
    return cls


class GoStyleUnimplemented(grpc.GenericRpcHandler):
    """Answers unknown methods and services with grpc-go's wording (docs/kubelet.md#unknown-methods).

    grpcio says `Method not found!` for both; the kubelet (Go) tells them apart,
    and that difference is what the sidecar's kubelet probe relies on.
    """

    def __init__(self, known_services: Mapping[str, Any]) -> None:
        self._known = known_services

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if service in self._known:
            message = f"unknown method {method} for service {service}"
        else:
            message = f"unknown service {service}"

        async def unimplemented(_request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

        return grpc.unary_unary_rpc_method_handler(unimplemented)
