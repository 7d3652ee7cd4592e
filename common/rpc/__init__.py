"""Generated protobuf/gRPC modules (package pdserve.v1); regenerate with `make proto`.

Do not edit the *_pb2* files by hand: tests/unit/test_proto_fresh.py fails when they differ from
what proto/*.proto generates. Services convert these messages to typed dataclasses at the edge.
"""
