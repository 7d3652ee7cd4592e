"""Which roles may call a gRPC server: a server interceptor over the peer's verified certificate.

Mutual TLS (services/common/tls.py) proves that a caller holds a certificate from the stack's
CA; it does not say what the caller is. Every leaf `pdserve certs` (and the chart's
Certificates) makes names its role as a SAN `<role>.pdserve.internal` (`tls.peer_name`), so a
server can tell a router from an API client or a storage node.

Contract:
- Active only on a server with TLS on: the handshake has already refused any peer without a
  certificate from the CA. Without TLS there is no identity to check (plaintext is the
  operator's explicit `--insecure` choice).
- A call to a guarded method whose peer certificate names none of the `allowed` roles ends with
  PERMISSION_DENIED before any servicer code runs.
- Read-only status methods are open to every certificate of the CA (probes, the launcher,
  `healthcheck.py`, grpcurl): the standard `grpc.health.v1` service, server reflection, and
  each service's own `Health` and `GetLoad` RPCs (`OPEN_METHODS`).
- The check is per call (one dictionary lookup of the auth context), never per message.
"""

from __future__ import annotations

import inspect
from typing import Iterable

import grpc

from pdserve.services.common.tls import NAME_SUFFIX, ROLES

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_METHODS = ("Health", "GetLoad")  # read-only status of any of our services

# Who may call whom (the chart's NetworkPolicies draw the same graph at the network level).
ENGINE_CALLERS = frozenset({"router"})
MASTER_CALLERS = frozenset({"prefill", "decode", "router", "kvstore-node", "kvstore-master"})


def peer_roles(context) -> frozenset[str]:
    """The roles the peer's verified certificate names (empty without TLS)."""
    found = set()
    for san in context.auth_context().get("x509_subject_alternative_name", ()):
        name = san.decode("ascii", "replace") if isinstance(san, bytes) else str(san)
        if name.endswith(NAME_SUFFIX) and name[:-len(NAME_SUFFIX)] in ROLES:
            found.add(name[:-len(NAME_SUFFIX)])
    return frozenset(found)


def is_open(method: str) -> bool:
    """`/package.Service/Method` that any certificate of the CA may call."""
    return method.startswith(OPEN_PREFIXES) or method.rsplit("/", 1)[-1] in OPEN_METHODS


class RoleCheck(grpc.aio.ServerInterceptor):
    """Lets a guarded method run only for peers of the `allowed` roles (see module doc)."""

    def __init__(self, allowed: Iterable[str]):
        allowed = frozenset(allowed)
        unknown = allowed - set(ROLES)
        if not allowed or unknown:
            raise ValueError(f"allowed roles must be a non-empty subset of {ROLES}, "
                             f"got {sorted(allowed)}")
        self.allowed = allowed

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open(handler_call_details.method):
            return handler
        return _guarded(handler, self.allowed, handler_call_details.method)


def interceptors_for(tls_enabled: bool, allowed: Iterable[str]) -> list:
    """The server interceptors a service passes to `grpc.aio.server`: the role check with TLS
    on, none without."""
    return [RoleCheck(allowed)] if tls_enabled else []


def _denied(context, allowed: frozenset[str], method: str) -> str:
    roles = peer_roles(context)
    if roles & allowed:
        return ""
    return (f"{method} is for {', '.join(sorted(allowed))} certificates; this one names "
            f"{', '.join(sorted(roles)) or 'no pdserve role'}")


def _guarded(handler, allowed: frozenset[str], method: str):
    """`handler` with its behaviour wrapped in the role check (all four call shapes; a
    streaming behaviour may be an async generator or a coroutine that writes)."""
    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
             ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler))
    for attr, make in kinds:
        behavior = getattr(handler, attr)  # grpc's RpcMethodHandler fields, not a probe
        if behavior is not None:
            return make(_wrap(behavior, allowed, method),
                        request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


def _wrap(behavior, allowed: frozenset[str], method: str):
    if inspect.isasyncgenfunction(behavior):
        async def gen(request, context):
            why = _denied(context, allowed, method)
            if why:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            async for item in behavior(request, context):
                yield item
        return gen

    async def call(request, context):
        why = _denied(context, allowed, method)
        if why:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result
    return call
