"""Router settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    model: str = "smollm2"  # what the router loads its tokenizer from
    backends: tuple[str, ...] = ("127.0.0.1:50051",)  # unified decode instances, host:port
    served_model_name: str = ""  # the name clients send; "" -> `model`
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP; 0 -> any free port
    grpc_port: int = 50050  # the Router gRPC API; 0 -> any free port, -1 -> off
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2  # consecutive failed checks before an instance is marked down
    max_n: int = 8  # choices per request
    max_stop: int = 8  # stop strings per request
    default_chat_max_tokens: int = 1024  # chat without max_tokens: capped by the model length
    grace_s: float = 2.0  # on shutdown, how long requests in flight may finish
    # Disaggregated mode (on when prefill_backends is set): `backends` are decode instances.
    prefill_backends: tuple[str, ...] = ()  # prefill instances, host:port
    kv_store: str = ""  # the KV store master, host:port (asked which prompt blocks it holds)
    min_prefill_tokens: int = 0  # fewer uncached prompt tokens -> decode computes them itself
    prefill_timeout_s: float = 60.0  # a slower Prefill is given up (and retried elsewhere)
    kv_lookup_timeout_s: float = 1.0

    def __post_init__(self):
        if not self.model:
            raise ValueError("model must be a non-empty name or path")
        if not self.backends:
            raise ValueError("backends must list at least one host:port")
        for name in ("backends", "prefill_backends"):
            for b in getattr(self, name):
                _check_address(name, b)
        if self.prefill_backends and not self.kv_store:
            raise ValueError("prefill_backends need kv_store (the KV store master host:port)")
        if self.kv_store:
            _check_address("kv_store", self.kv_store)
        if self.min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {self.min_prefill_tokens}")
        if self.prefill_timeout_s <= 0 or self.kv_lookup_timeout_s <= 0:
            raise ValueError("prefill_timeout_s and kv_lookup_timeout_s must be > 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [-1, 65535], got {self.grpc_port}")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health_interval_s and health_timeout_s must be > 0")
        if self.unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {self.unhealthy_after}")
        if self.max_n < 1 or self.max_stop < 0 or self.default_chat_max_tokens < 1:
            raise ValueError("max_n and default_chat_max_tokens must be >= 1, max_stop >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_backends)


def _check_address(name: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{name} must be host:port, got {address!r}")
