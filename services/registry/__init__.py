"""Instance registry in Redis: engines heartbeat their address, role and load under a TTL
(heartbeat.py); routers watch the entries (watch.py)."""
