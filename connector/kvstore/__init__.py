"""The client side of the Mooncake-style KV store (services/kvstore runs the master and the
storage nodes): the one store client engines and the router use, its connection pool, the
storage node's wire format, the store's typed records and their proto conversions, and the
keys and capabilities that authenticate the store path (auth.py)."""
