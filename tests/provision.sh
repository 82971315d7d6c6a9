#!/usr/bin/env bash
# What some tests need beyond the Python packages, installed with the rest (the README's test command runs this
# before pytest; the tests only look for it and skip, saying why, where it is missing):
#   byte-code for .venv's packages, compiled on every core (the README's pip install passes --no-compile: pip
#             compiles ~13k files on one core, 28 s of the 64 s install on a 2-core box; this takes 18 s)
#   chromium  (Debian package; tests/test_dashboard.py renders the dashboard in it)    -- as root with apt-get
#   nftables  (Debian package; tests/test_nat.py builds NAT namespaces with nft)       -- as root with apt-get
#   tests/js/node_modules (npm ci, the versions pinned in tests/js/package-lock.json;
#             tests/test_dht_interop.py runs a js-libp2p DHT node)                     -- where node >= 20 and npm are
# Installs what it can and never fails: a machine without root, apt-get, node or a network still runs the suite.
set -u
cd "$(dirname "$0")"

say() { echo "provision: $*" >&2; }

apt_install() {  # apt_install <command> <package>: install Debian's package unless the command is there already
    command -v "$1" >/dev/null && return
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "no $1, and installing $2 needs root and apt-get (the tests that need it skip)"
        return
    fi
    export DEBIAN_FRONTEND=noninteractive
    timeout 900 apt-get install -y -q "$2" >/dev/null 2>&1 ||
        { timeout 300 apt-get update -q >/dev/null 2>&1 && timeout 900 apt-get install -y -q "$2" >/dev/null 2>&1; }
    command -v "$1" >/dev/null || say "apt-get could not install $2 (the tests that need it skip)"
}

npm_install() {  # the pinned js-libp2p packages, once per package-lock.json (a marker holds the hash installed)
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
        say "no node/npm: tests/test_dht_interop.py's js tests skip"
        return
    fi
    local major wanted marker=js/node_modules/.swarmrl-installed
    major=$(node --version | sed 's/^v//; s/\..*//')
    if [ "${major:-0}" -lt 20 ]; then
        say "js-libp2p needs Node.js >= 20, found $(node --version): the js interop tests skip"
        return
    fi
    wanted=$(cat js/package.json js/package-lock.json | sha256sum | cut -d' ' -f1)
    [ -f "$marker" ] && [ "$(cat "$marker")" = "$wanted" ] && return
    local log=../runs/provision-npm-ci.log  # runs/ is git-ignored
    mkdir -p ../runs
    if (cd js && timeout 900 npm ci --no-audit --no-fund --loglevel=error >/dev/null 2>"../$log"); then
        printf %s "$wanted" >"$marker"
    else
        say "npm ci in tests/js failed (registry unreachable?): the js interop tests skip; see ${log#../}"
    fi
}

compile_venv() {  # errors are not ours: pip skips files it cannot compile too (torch ships Python 3.12 syntax)
    [ -x ../.venv/bin/python ] || return
    ../.venv/bin/python -m compileall -q -j 0 ../.venv/lib >/dev/null 2>&1 || true
}

compile_venv
apt_install chromium chromium
apt_install nft nftables
npm_install
exit 0
