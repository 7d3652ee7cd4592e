#!/usr/bin/env bash
# Make sure `redis-server` is on PATH (the KV store master keeps its metadata in Redis, and
# its tests start a private redis-server). Idempotent: does nothing when it is already there;
# otherwise installs Debian's redis-server package (needs root, as on our dev and CI machines).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_redis: redis-server missing and no apt-get here; install redis-server" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
sudo_cmd=""
if [[ "$(id -u)" != 0 ]]; then sudo_cmd="sudo"; fi
$sudo_cmd apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1 || {
  $sudo_cmd apt-get update >/dev/null
  $sudo_cmd apt-get install -y --no-install-recommends redis-server >/dev/null
}
# The package starts a system-wide service; ours start their own on free ports instead.
command -v redis-server >/dev/null
