#!/usr/bin/env bash
# ensure_debian_tool.sh COMMAND PACKAGE: make sure COMMAND is on PATH, installing Debian's
# PACKAGE when it is missing (needs root, as on our dev and CI machines). Idempotent. A package
# that starts a system-wide service is harmless: our tests and stacks start their own copies
# on free ports.
set -euo pipefail
cmd=$1 pkg=$2
if command -v "$cmd" >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_debian_tool: $cmd missing and no apt-get here; install $pkg" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
sudo_cmd=""
if [[ "$(id -u)" != 0 ]]; then sudo_cmd="sudo"; fi
$sudo_cmd apt-get install -y --no-install-recommends "$pkg" >/dev/null 2>&1 || {
  $sudo_cmd apt-get update >/dev/null
  $sudo_cmd apt-get install -y --no-install-recommends "$pkg" >/dev/null
}
command -v "$cmd" >/dev/null
