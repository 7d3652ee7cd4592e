"""Registry settings: where instances register (a Redis URL), how often, and for how long an
entry outlives its last heartbeat. Engines get them from `EngineServiceConfig`
(`--registry`, `--advertise-address`, `--registry-interval`, `--registry-ttl`), routers from
`RouterConfig`; nothing is read from the environment. A Redis password belongs in the URL,
which then comes from a file (`--registry @FILE`, services/common/arg_files.py)."""

from __future__ import annotations

from dataclasses import dataclass

KEY_PREFIX = "pdserve:instance:"


@dataclass(frozen=True)
class RegistryConfig:
    url: str  # redis://[:password@]host:port/db
    ttl_s: float = 3.0  # an instance that stops heartbeating drops out after this
    interval_s: float = 1.0  # heartbeat (engines) and poll (routers) period
    key_prefix: str = KEY_PREFIX
    summary_blocks: int = 2048  # newest cached block keys an engine reports

    def __post_init__(self):
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("registry url must be redis://..., rediss://... or unix://..., "
                             f"got {self.url.split('://')[0]!r}://...")
        if self.interval_s <= 0 or self.ttl_s <= self.interval_s:
            raise ValueError("registry interval_s must be > 0 and ttl_s > interval_s")
        if not self.key_prefix or self.summary_blocks < 0:
            raise ValueError("key_prefix must be set and summary_blocks >= 0")


@dataclass(frozen=True)
class Registration:
    """How one engine instance registers: the engine service config carries it, the
    `pdserve serve decode|prefill` registry flags take their defaults from it."""

    url: str = ""  # redis://[:password@]HOST:PORT/DB; "" -> this instance does not register
    advertise_address: str = ""  # host:port routers dial; "" -> the service's host:port
    interval_s: float = RegistryConfig.interval_s  # heartbeat period
    ttl_s: float = RegistryConfig.ttl_s  # an entry outlives its last heartbeat this long

    def __post_init__(self):
        host, sep, port = self.advertise_address.rpartition(":")
        if self.advertise_address and not (sep and host and port.isdigit()
                                           and 0 < int(port) < 65536):
            raise ValueError("advertise_address must be host:port, got "
                             f"{self.advertise_address!r}")
        self.registry_config()

    def registry_config(self) -> "RegistryConfig | None":
        """Where to heartbeat; None without a URL."""
        if not self.url:
            return None
        return RegistryConfig(self.url, ttl_s=self.ttl_s, interval_s=self.interval_s)
