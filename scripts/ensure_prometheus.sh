#!/usr/bin/env bash
# Make sure Debian's `prometheus` binary is on PATH (the dashboard test starts a private one
# that scrapes a live tiny stack). Idempotent: does nothing when it is already there; otherwise
# installs Debian's prometheus package (needs root, as on our dev and CI machines).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_prometheus: prometheus missing and no apt-get here; install prometheus" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
sudo_cmd=""
if [[ "$(id -u)" != 0 ]]; then sudo_cmd="sudo"; fi
$sudo_cmd apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || {
  $sudo_cmd apt-get update >/dev/null
  $sudo_cmd apt-get install -y --no-install-recommends prometheus >/dev/null
}
# The package may start a system-wide service on :9090; the test runs its own on a free port.
command -v prometheus >/dev/null
