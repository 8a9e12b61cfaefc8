#!/usr/bin/env bash
# The metrics tests run a real Prometheus server (Debian's package). Install it when missing.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
  echo "prometheus is not installed and this user cannot install it; the metrics tests will fail" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# Debian's package starts a system service; the tests run their own server on a private port.
$SUDO systemctl stop prometheus 2>/dev/null || $SUDO pkill -x prometheus 2>/dev/null || true
command -v prometheus
