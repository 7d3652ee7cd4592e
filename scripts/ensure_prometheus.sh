#!/usr/bin/env bash
# Make sure Debian's `prometheus` is on PATH (the dashboard test starts a private one that
# scrapes a live tiny stack).
exec bash "$(dirname "$0")/ensure_debian_tool.sh" prometheus prometheus
