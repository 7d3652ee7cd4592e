"""Router settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.common.tls import TlsConfig
from pdserve.services.router.admission.admission_config import AdmissionConfig
from pdserve.services.router.dispatch.fallback_config import FallbackConfig
from pdserve.services.router.limits_config import LimitsConfig
from pdserve.services.router.routing.routing_config import RoutingConfig


@dataclass(frozen=True)
class RouterConfig:
    model: str = "smollm2"  # what the router loads its tokenizer from
    # Unified decode instances: host:port, or dns:NAME:PORT (one instance per address NAME
    # resolves to, re-resolved every dns_interval_s). May be empty with a registry.
    backends: tuple[str, ...] = ("127.0.0.1:50051",)
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
    kv_block_secret_file: str = ""  # the engines' block secret: the store's keys of prompt blocks
    # Conditional disaggregation: the least-queued prefill instance has more prompt tokens
    # queued than this -> decode computes the prompt itself. 0: no limit.
    max_prefill_queue_tokens: int = 0
    registry_url: str = ""  # redis://...: instances join and leave through the registry
    registry_interval_s: float = 0.5  # how often the router reads it
    dns_interval_s: float = 5.0
    api_key_file: str = ""  # one key per line; set -> requests need Authorization: Bearer
    # The secret that keys tenants' cache salts (admission/tenants.py); "" -> random per start
    tenant_secret_file: str = ""
    routing: RoutingConfig = RoutingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    fallback: FallbackConfig = FallbackConfig()
    limits: LimitsConfig = LimitsConfig()
    # Mutual TLS for the router's gRPC API and its channels to the engines; empty: plaintext
    tls: TlsConfig = TlsConfig()
    # Processes serving this router's ports (services/router/workers.py): 1 -> this process
    # serves alone; N > 1 -> this process supervises N workers that share the HTTP and gRPC
    # ports (SO_REUSEPORT), each enforcing 1/N of the admission and connection limits.
    workers: int = 1
    worker_index: int = -1  # >= 0: this process is that worker of `workers` (set by the supervisor)

    def __post_init__(self):
        if not self.model:
            raise ValueError("model must be a non-empty name or path")
        if not self.backends and not self.registry_url:
            raise ValueError("backends must list at least one host:port (or use a registry)")
        for name in ("backends", "prefill_backends"):
            for b in getattr(self, name):
                _check_address(name, b.removeprefix("dns:"))
        if self.disaggregated and not self.kv_store:
            raise ValueError("prefill_backends need kv_store (the KV store master host:port)")
        if self.registry_url and not self.registry_url.startswith(("redis://", "rediss://",
                                                                   "unix://")):
            raise ValueError("registry_url must be redis://... (its scheme was "
                             f"{self.registry_url.split('://')[0]!r})")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError("max_prefill_queue_tokens must be >= 0")
        if self.registry_interval_s <= 0 or self.dns_interval_s <= 0:
            raise ValueError("registry_interval_s and dns_interval_s must be > 0")
        if self.kv_store:
            _check_address("kv_store", self.kv_store)
        if self.min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {self.min_prefill_tokens}")
        if self.prefill_timeout_s <= 0 or self.kv_lookup_timeout_s <= 0:
            raise ValueError("prefill_timeout_s and kv_lookup_timeout_s must be > 0")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be in [1, 64], got {self.workers}")
        if not -1 <= self.worker_index < self.workers:
            raise ValueError(f"worker_index must be in [-1, {self.workers}), got "
                             f"{self.worker_index}")
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
        """Prefill instances listed, or (with a registry and a KV store) to be discovered."""
        return bool(self.prefill_backends) or bool(self.registry_url and self.kv_store)


def _check_address(name: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{name} must be host:port, got {address!r}")
