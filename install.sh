#!/usr/bin/env bash
# Installs ftd on a fresh Debian/Ubuntu machine: etcd-server from apt, ftd and its Python
# dependencies in ./.venv.
#   ./install.sh          what `ftctl demo` needs
#   ./install.sh --dev    plus the test, lint and type-check tools
set -euo pipefail
cd "$(dirname "$0")"

extras=""
if [[ "${1:-}" == "--dev" ]]; then extras="dev"; fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi

apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -qq "$@" >/dev/null 2>&1 || {
    $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq "$@" >/dev/null
  }
}

# etcd v3 server (Debian's 3.4). ftd starts its own members on free loopback ports, so the
# etcd.service the package enables on systemd hosts is not used by ftd.
if ! command -v etcd >/dev/null 2>&1 && [[ ! -x /usr/bin/etcd ]]; then
  echo "install.sh: installing etcd-server"
  apt_install etcd-server
fi

# The test suite checks deployment artefacts with the ecosystem's own tools: promtool (Debian's
# prometheus package), systemd-analyze (systemd) and headless Chromium (the drill report).
if [[ -n "$extras" ]]; then
  need=()
  command -v promtool >/dev/null 2>&1 || need+=(prometheus)
  command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  # Network namespaces, partitions and delays for ftctl up --isolate and the chaos matrix.
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  command -v nft >/dev/null 2>&1 || need+=(nftables)
  # etcdctl runs the etcd auth script of deploy/ in its test.
  command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
  if (( ${#need[@]} )); then
    echo "install.sh: installing test tools: ${need[*]}"
    apt_install "${need[@]}"
  fi
fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv 2>/dev/null || { apt_install python3-venv && python3 -m venv .venv; }
fi
.venv/bin/python -m pip install -q --upgrade pip
# The training side needs torch; 2.13.0 is the CPU build this kind of machine has on disk (a bare
# `torch` would download a multi-GB CUDA build). An existing torch is kept.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[torch${extras:+,dev}]"
echo "install.sh: ftd installed in $(pwd)/.venv ($(.venv/bin/python --version))"
