#!/usr/bin/env bash
# The system packages the test suite uses, installed when they are missing and this runs as
# root with a Debian/Ubuntu package manager (CI, a fresh container):
#   etcd-server     cluster membership tests start their own etcd
#   iproute2        network namespaces and tc for the multi-host fault tests
#   python3-pyverbs Debian's pyverbs for the system Python (device-free RDMA checks)
# Quiet and idempotent: nothing happens when everything is there. It never fails the build:
# not root, no apt-get, offline or a package that does not exist -> one line on stderr, and the
# tests that need the missing part skip with their reason.
set -u
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need+=(iproute2)
/usr/bin/python3 -c "import pyverbs" >/dev/null 2>&1 || need+=(python3-pyverbs)
[ "${#need[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: not installing ${need[*]} (needs root and apt-get); tests that need them skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt_opts=(-q -o Acquire::Retries=1 -o Acquire::http::Timeout=20 -o Acquire::https::Timeout=20)
bounded() { if command -v timeout >/dev/null 2>&1; then timeout 600 "$@"; else "$@"; fi; }
if ! bounded apt-get "${apt_opts[@]}" update >/dev/null 2>&1; then
    echo "system-deps: apt-get update failed (offline?); tests that need ${need[*]} skip" >&2
    exit 0
fi
# one package at a time: a package this release lacks must not keep the others out
for p in "${need[@]}"; do
    if ! bounded apt-get "${apt_opts[@]}" install -y --no-install-recommends "$p" >/dev/null 2>&1; then
        echo "system-deps: could not install $p; tests that need it skip" >&2
    fi
done
exit 0
