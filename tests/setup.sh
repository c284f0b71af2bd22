#!/usr/bin/env bash
# What the test suite needs, idempotent: Prometheus' promtool and server (Debian package prometheus,
# installed with apt-get as root where missing), then moerl with its test extra. Exits non-zero with one
# line saying what is missing and why when it cannot install them: the tests that need them fail, not skip.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "tests/setup.sh: promtool/prometheus missing and not root: install Debian package prometheus (or put both on PATH) and rerun" >&2
        exit 1
    elif ! command -v apt-get >/dev/null 2>&1; then
        echo "tests/setup.sh: promtool/prometheus missing and no apt-get: install Prometheus 2.x (promtool, prometheus) on PATH and rerun" >&2
        exit 1
    elif ! { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }; then
        echo "tests/setup.sh: apt-get install prometheus failed: promtool/prometheus missing (see apt-get's output above)" >&2
        exit 1
    fi
    for p in promtool prometheus; do
        command -v "$p" >/dev/null 2>&1 || { echo "tests/setup.sh: $p still missing after apt-get install prometheus" >&2; exit 1; }
    done
fi
python3 -m pip install -q torch==2.13.0 -e '.[test]' || { echo "tests/setup.sh: pip install of moerl[test] failed (see above)" >&2; exit 1; }
# Triton for its CPU interpreter (TRITON_INTERPRET=1), in a folder of its own: only the paged-attention
# kernel test puts it on its subprocess' path, so no other test imports Triton on this CPU machine
if [ ! -d .cache/triton-interp/triton ]; then
    python3 -m pip install -q --target .cache/triton-interp triton==3.5.0 || { echo "tests/setup.sh: pip install of triton (the kernel tests' CPU interpreter) into .cache/triton-interp failed (see above)" >&2; exit 1; }
fi
