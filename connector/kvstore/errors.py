"""Errors of the KV store client: only unavailability raises; a miss is a return value."""


class KVStoreUnavailable(ConnectionError):
    """The master or every replica's storage node cannot be reached."""
