"""The client's connection: its gRPC channel (plaintext or TLS, a connection of its own),
unary methods taking request bytes as they are, and the Session stream."""

from __future__ import annotations

from typing import Any

import grpc

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client.call_stream import CallStream
from cache_service.wire.tls import ClientTLSConfig, channel_credentials, channel_options

__all__ = ["SERVICE", "open_channel", "raw_unary", "session_stream"]

SERVICE = pb.DESCRIPTOR.services_by_name["KVCache"].full_name


def open_channel(target: str, tls: ClientTLSConfig | None, max_message_bytes: int) -> grpc.Channel:
    """A channel to `target` ("host:port"), TLS when `tls`, sending and receiving messages
    of up to `max_message_bytes`."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A connection of its own (gRPC shares one between channels of a process by
        # default): the server's per-client in-flight limit counts per connection.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    options += channel_options(tls)
    return grpc.secure_channel(target, channel_credentials(tls), options=options)


def raw_unary(channel: grpc.Channel, name: str, response: Any) -> Any:
    """A unary method of the service taking request bytes as they are (no serializer)."""
    return channel.unary_unary(
        f"/{SERVICE}/{name}",
        request_serializer=None,
        response_deserializer=response.FromString,
    )


def session_stream(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> CallStream:
    """The Session stream of `channel` (opened on its first call), bytes in and out."""
    return CallStream(
        channel.stream_stream(
            f"/{SERVICE}/Session", request_serializer=None, response_deserializer=None
        ),
        metadata=metadata,
    )
