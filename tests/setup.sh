#!/usr/bin/env bash
# What the test suite needs, idempotent: Prometheus' promtool and server (Debian package prometheus;
# only as root, where missing: the tests that need them skip with a reason otherwise), then moerl
# with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null \
            || echo "tests/setup.sh: could not install prometheus; promtool tests will skip" >&2
    else
        echo "tests/setup.sh: promtool/prometheus missing and not root; promtool tests will skip" >&2
    fi
fi
python3 -m pip install -q torch==2.13.0 -e '.[test]'
