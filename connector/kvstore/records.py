"""Typed records of the KV store (proto stays at the gRPC edge, see convert.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ObjectState(str, enum.Enum):
    PROCESSING = "processing"  # space reserved, bytes being written: invisible to readers
    COMPLETE = "complete"


class PutStatus(enum.Enum):
    OK = "ok"
    EXISTS = "exists"  # stored and complete: readable
    # (master side) another put still writes the key; the client waits for that put to end,
    # or takes the key over if it is revoked (batch_put.settle_writing), so callers get
    # EXISTS, their own write's outcome or UNSETTLED, never this
    WRITING = "writing"
    NO_SPACE = "no_space"
    NOT_ENOUGH_NODES = "not_enough_nodes"
    REVOKED = "revoked"  # (client side) the master gave the write up before it ended
    # (client side) WRITING, and the other writer's put had not ended by our settle deadline:
    # the object is not readable, so it does not count as stored
    UNSETTLED = "unsettled"


@dataclass(frozen=True)
class Replica:
    node_id: str
    address: str
    offset: int
    capability: bytes = b""  # the master's grant for one op on this range (auth.py); never stored


@dataclass(frozen=True)
class ObjectMeta:
    key: bytes
    size: int
    replicas: tuple[Replica, ...]
    state: ObjectState
    lease_until: float  # wall-clock seconds; not evicted or removed (unforced) before it
    last_access: float
    put_deadline: float  # a PROCESSING object still unfinished by then is revoked


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    capacity: int
    incarnation: str


@dataclass(frozen=True)
class PutStart:
    status: PutStatus
    replicas: tuple[Replica, ...] = ()


@dataclass(frozen=True)
class ReplicaList:
    size: int
    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class NodeUsage:
    node_id: str
    address: str
    capacity: int
    used: int


@dataclass(frozen=True)
class StoreStats:
    objects: int
    evictions: int
    nodes: tuple[NodeUsage, ...]
