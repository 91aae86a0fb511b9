#!/usr/bin/env bash
# tests/browser drives Debian's chromium through Playwright (never a Playwright browser download).
# Installs the apt package when it is missing and this runs as root (CI); otherwise says why the
# browser tests will be skipped. Safe to run twice.
set -uo pipefail
[ -x /usr/bin/chromium ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium is missing and cannot be installed here (needs root and apt-get): tests/browser will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
  || echo "apt-get could not install chromium: tests/browser will be skipped" >&2
exit 0
