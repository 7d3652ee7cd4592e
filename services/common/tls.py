"""Mutual TLS for pdserve's internal gRPC plane: one frozen TlsConfig (a CA bundle, this
process's certificate and key) and the grpc credentials made from it.

Contract:
- `TlsConfig()` (all paths empty) means plaintext; all three paths set means mutual TLS; any
  other mix is refused at construction (ValueError), so a half-configured service never starts.
- A server built with `server_credentials` accepts only clients that present a certificate
  chaining to the CA (`require_client_auth=True`): a client without one, or with one from
  another CA, fails the handshake and never reaches a servicer (the caller sees UNAVAILABLE).
- A channel built with `channel_credentials` presents this process's certificate and checks the
  server's against the same CA. Peers are named by role, not by address: pods and registry
  entries are dialed by IP, which no certificate can list ahead of time, so `open_channel`
  checks the server's certificate for the role's name (`peer_name(role)`, a SAN that
  `pdserve certs` and the chart's Certificates put in every role's certificate).
- Files are read when credentials are made (process start), not per call; a missing or
  unreadable file raises OSError there, naming the path.

Torch-free: the router, the store and the CLI import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import grpc

CA_FILE = "ca.pem"
ROLES = ("router", "prefill", "decode", "kvstore-master", "kvstore-node", "client")
NAME_SUFFIX = ".pdserve.internal"  # peer names: decode.pdserve.internal, ...


def peer_name(role: str) -> str:
    """The DNS name (a SAN of `role`'s certificate) a client checks on a server of `role`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role + NAME_SUFFIX


def cert_file(role: str) -> str:
    return f"{role}.pem"


def key_file(role: str) -> str:
    return f"{role}-key.pem"


@dataclass(frozen=True)
class TlsConfig:
    ca: str = ""  # PEM bundle of the CA(s) that peers' certificates must chain to
    cert: str = ""  # this process's certificate chain (PEM)
    key: str = ""  # its private key (PEM)

    def __post_init__(self):
        given = [bool(self.ca), bool(self.cert), bool(self.key)]
        if any(given) and not all(given):
            raise ValueError("TLS needs all of ca, cert and key (or none of them for "
                             f"plaintext); got ca={self.ca!r} cert={self.cert!r} "
                             f"key={self.key!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    @classmethod
    def from_dir(cls, directory: str, role: str) -> "TlsConfig":
        """The layout `pdserve certs` writes: DIR/ca.pem, DIR/<role>.pem, DIR/<role>-key.pem."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        d = Path(directory)
        return cls(str(d / CA_FILE), str(d / cert_file(role)), str(d / key_file(role)))


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read TLS file {path}: {exc.strerror or exc}") from exc


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Credentials for a server that requires a client certificate signed by `tls.ca`."""
    if not tls.enabled:
        raise ValueError("server_credentials needs a TlsConfig with ca, cert and key")
    return grpc.ssl_server_credentials([(_read(tls.key), _read(tls.cert))],
                                       root_certificates=_read(tls.ca),
                                       require_client_auth=True)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials for a channel that presents this process's certificate."""
    if not tls.enabled:
        raise ValueError("channel_credentials needs a TlsConfig with ca, cert and key")
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca),
                                        private_key=_read(tls.key),
                                        certificate_chain=_read(tls.cert))


def add_port(server, address: str, tls: TlsConfig) -> int:
    """`server.add_secure_port` with mutual TLS when `tls` is on, else the insecure port; the
    bound port (0 when binding failed), for sync and aio servers alike."""
    if tls.enabled:
        return server.add_secure_port(address, server_credentials(tls))
    return server.add_insecure_port(address)


def channel_options(server_role: str,
                    options: Sequence[tuple] = ()) -> list[tuple]:
    """`options` plus the name to check on the server's certificate (see `peer_name`)."""
    return list(options) + [("grpc.ssl_target_name_override", peer_name(server_role))]


def open_channel(address: str, tls: TlsConfig, server_role: str,
                 options: Sequence[tuple] = (), interceptors: Optional[list] = None,
                 aio: bool = True):
    """A grpc.aio (or, with aio=False, a blocking) channel to a `server_role` server at
    `address`: mutual TLS when `tls` is on, plaintext otherwise."""
    mod = grpc.aio if aio else grpc
    kwargs = {"interceptors": interceptors} if interceptors is not None else {}
    if not tls.enabled:
        return mod.insecure_channel(address, options=list(options) or None, **kwargs)
    return mod.secure_channel(address, channel_credentials(tls),
                              options=channel_options(server_role, options), **kwargs)
