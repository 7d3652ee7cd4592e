#!/usr/bin/env bash
# Make sure `redis-server` is on PATH (the KV store master and the instance registry keep
# their state in Redis, and the tests start private redis-servers).
exec bash "$(dirname "$0")/ensure_debian_tool.sh" redis-server redis-server
