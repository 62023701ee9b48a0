#!/usr/bin/env bash
# Installs what the multi-host tests need: sshd (one per test "host"), pdsh (DeepSpeed's default
# multi-node launcher) and iproute2 (network namespaces). Idempotent: installs only what is missing,
# so CI can call it on every run without touching apt when everything is already there.
set -euo pipefail

need=()
command -v sshd >/dev/null 2>&1 || [[ -x /usr/sbin/sshd ]] || need+=(openssh-server)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
command -v ip >/dev/null 2>&1 || need+=(iproute2)

if ((${#need[@]} == 0)); then
    echo "install_test_deps: openssh-server, pdsh and iproute2 already installed"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install_test_deps: need root to apt-get install ${need[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
echo "install_test_deps: installed ${need[*]}"
