"""Message size limits for a gRPC server or channel, as grpcio takes them (one place, so the
router's servers and channels and the engines' servers agree)."""

from __future__ import annotations


def grpc_limits(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options bounding each message both ways: a larger one is refused with
    RESOURCE_EXHAUSTED ("... message larger than max ...") before it is processed."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]
