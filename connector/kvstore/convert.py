"""Proto <-> typed records for the KV store's gRPC edge."""

from __future__ import annotations

from pdserve.common.rpc import kvstore_pb2 as pb
from pdserve.connector.kvstore.records import (NodeInfo, NodeUsage, PutStart, PutStatus,
                                               Replica, ReplicaList, StoreStats)

_PUT_STATUS = {
    PutStatus.OK: pb.PUT_START_OK,
    PutStatus.EXISTS: pb.PUT_START_EXISTS,
    PutStatus.NO_SPACE: pb.PUT_START_NO_SPACE,
    PutStatus.NOT_ENOUGH_NODES: pb.PUT_START_NOT_ENOUGH_NODES,
    PutStatus.WRITING: pb.PUT_START_WRITING,
}
_PUT_STATUS_BACK = {v: k for k, v in _PUT_STATUS.items()}


def replica_to_pb(r: Replica) -> pb.Replica:
    return pb.Replica(node_id=r.node_id, address=r.address, offset=r.offset,
                      capability=r.capability)


def replica_from_pb(m: pb.Replica) -> Replica:
    return Replica(m.node_id, m.address, m.offset, m.capability)


def put_start_to_pb(p: PutStart) -> pb.PutStartResponse:
    return pb.PutStartResponse(status=_PUT_STATUS[p.status],
                               replicas=[replica_to_pb(r) for r in p.replicas])


def put_start_from_pb(m: pb.PutStartResponse) -> PutStart:
    if m.status not in _PUT_STATUS_BACK:
        raise ValueError(f"master answered an unknown PutStart status {m.status}")
    return PutStart(_PUT_STATUS_BACK[m.status], tuple(replica_from_pb(r) for r in m.replicas))


def put_starts_from_pb(m: pb.BatchPutStartResponse, count: int) -> list[PutStart]:
    """A BatchPutStart's answer: one result per entry asked for (ValueError otherwise)."""
    if len(m.results) != count:
        raise ValueError(f"master answered {len(m.results)} PutStart results for {count}")
    return [put_start_from_pb(r) for r in m.results]


def replica_list_to_pb(rl: ReplicaList | None) -> pb.GetReplicaListResponse:
    if rl is None:
        return pb.GetReplicaListResponse(found=False)
    return pb.GetReplicaListResponse(found=True, size=rl.size,
                                     replicas=[replica_to_pb(r) for r in rl.replicas])


def replica_list_from_pb(m: pb.GetReplicaListResponse) -> ReplicaList | None:
    if not m.found:
        return None
    return ReplicaList(m.size, tuple(replica_from_pb(r) for r in m.replicas))


def node_to_pb(n: NodeInfo) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(node_id=n.node_id, address=n.address, capacity=n.capacity,
                                  incarnation=n.incarnation)


def node_from_pb(m: pb.RegisterNodeRequest) -> NodeInfo:
    if not m.node_id or ":" not in m.address or m.capacity == 0:
        raise ValueError("a node registers with an id, a host:port address and a capacity")
    return NodeInfo(m.node_id, m.address, m.capacity, m.incarnation)


def stats_to_pb(s: StoreStats) -> pb.StatsResponse:
    return pb.StatsResponse(objects=s.objects, evictions=s.evictions, nodes=[
        pb.NodeStats(node_id=n.node_id, address=n.address, capacity=n.capacity, used=n.used)
        for n in s.nodes])


def stats_from_pb(m: pb.StatsResponse) -> StoreStats:
    return StoreStats(m.objects, m.evictions, tuple(
        NodeUsage(n.node_id, n.address, n.capacity, n.used) for n in m.nodes))
