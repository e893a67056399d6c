"""The kubelet's gRPC services, typed, with method paths taken from the project's own descriptors.

No `*_pb2_grpc.py` is generated: clients and servers here are built from the
service descriptors, so every path is the one the `.proto` files declare.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr

API_VERSION = "v1beta1"
REGISTRATION = dp.DESCRIPTOR.services_by_name["Registration"]
DEVICE_PLUGIN = dp.DESCRIPTOR.services_by_name["DevicePlugin"]
POD_RESOURCES = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


def method_path(service: Any, method: str) -> str:
    """`/package.Service/Method`, as gRPC puts it on the wire."""
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


def unix_target(path: str) -> str:
    """A grpc target for a Unix socket path (absolute or relative)."""
    return f"unix:{path}" if path.startswith("/") else f"unix:./{path}"


def insecure_channel(path: str) -> grpc.aio.Channel:
    """A channel of its own to a Unix socket.

    grpcio shares connections between channels to the same target by default;
    a probe or a dial that rides on another channel's live connection proves nothing.
    """
    return grpc.aio.insecure_channel(unix_target(path), options=[("grpc.use_local_subchannel_pool", 1)])


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def unary(
    channel: grpc.aio.Channel, service: Any, method: str, response: type[Resp]
) -> grpc.aio.UnaryUnaryMultiCallable[Message, Resp]:
    return unary_path(channel, method_path(service, method), response)


def unary_path(
    channel: grpc.aio.Channel, path: str, response: type[Resp]
) -> grpc.aio.UnaryUnaryMultiCallable[Message, Resp]:
    return channel.unary_unary(path, request_serializer=_serialize, response_deserializer=response.FromString)


def server_stream(
    channel: grpc.aio.Channel, service: Any, method: str, response: type[Resp]
) -> grpc.aio.UnaryStreamMultiCallable[Message, Resp]:
    return channel.unary_stream(
        method_path(service, method),
        request_serializer=_serialize,
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
            response_serializer=_serialize,
        )
    for name, stream in (streams or {}).items():
        method = service.methods_by_name[name]
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=_message_class(method.input_type).FromString,
            response_serializer=_serialize,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _message_class(descriptor: Any) -> type[Message]:
    module = dp if descriptor.file is dp.DESCRIPTOR else pr
    cls: type[Message] = getattr(module, descriptor.name)
    return cls


class GoStyleUnimplemented(grpc.GenericRpcHandler):
    """Answers unknown methods and services with grpc-go's wording (KUBELET-FACTS.md section 3).

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
