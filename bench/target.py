"""Which server the load goes to: an OpenAI-compatible HTTP API (ours or a peer's) or our gRPC."""

from __future__ import annotations

from dataclasses import dataclass

APIS = ("http", "grpc")


@dataclass(frozen=True)
class TargetConfig:
    api: str = "http"
    base_url: str = "http://127.0.0.1:8000"  # http: without /v1
    grpc_addr: str = "127.0.0.1:50050"  # the router's gRPC API
    model_name: str = ""  # http: '' -> the first model /v1/models lists
    temperature: float = 0.0
    top_p: float = 1.0  # < 1: every request sends top_p (what many OpenAI clients do)
    ignore_eos: bool = True  # outputs as long as asked, so runs compare like with like
    timeout_s: float = 600.0
    label: str = ""  # how reports name it ('' -> the address)
    tls_dir: str = ""  # grpc: `pdserve certs` folder; its client certificate for mutual TLS

    def __post_init__(self):
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {self.api!r}")
        if self.api == "http" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got "
                             f"{self.base_url!r}")
        if self.temperature < 0 or not self.timeout_s > 0:
            raise ValueError("temperature must be >= 0 and timeout_s > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def name(self) -> str:
        return self.label or (self.base_url if self.api == "http" else f"grpc://{self.grpc_addr}")


def make_client(target: TargetConfig):
    if target.api == "grpc":
        from pdserve.bench.client_grpc import GrpcClient

        return GrpcClient(target)
    from pdserve.bench.client_http import HttpClient

    return HttpClient(target)
