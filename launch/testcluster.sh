#!/usr/bin/env bash
# A real multi-host cluster on one machine, for testing launches without a cluster.
#
#   launch/testcluster.sh up N        N hosts dsnode0..dsnode{N-1}: one network namespace each, joined
#                                     by veth links to a bridge, each with its own sshd; prints the
#                                     hostfile (1 slot per host) and the env file to use
#   launch/testcluster.sh down        removes everything `up` made
#   launch/testcluster.sh status      lists the hosts and whether each sshd runs
#   launch/testcluster.sh sshd-stop I / sshd-start I
#                                     stops / starts host I's sshd (to test an unreachable host)
#
# Every "host" shares this machine's filesystem (so one venv serves all) but has its own network
# stack, its own address, sshd and /etc/hosts, so `deepspeed --hostfile` runs over pdsh + ssh exactly
# as it does on a cluster. Traffic stays on a private bridge: nothing is routed off the machine.
# `up` starts from `down`, so rerunning it (also after a crash) always gives a clean cluster.
# Needs root, iproute2 and openssh-server (launch/install_test_deps.sh).
set -euo pipefail

STATE_DIR=${DS_TESTCLUSTER_DIR:-/run/deepseek-ds-testcluster}
# A /24 that cluster networks rarely use; override if it clashes with a route on this machine.
SUBNET=${DS_TESTCLUSTER_SUBNET:-172.29.213}
BRIDGE=dsbr0
# The iptables rule `up` adds when bridge netfilter is on (see cmd_up), marked by its comment; `down` removes it.
FORWARD_ACCEPT=(FORWARD -i "$BRIDGE" -o "$BRIDGE" -m comment --comment deepseek-ds-testcluster -j ACCEPT)
HOST_PREFIX=dsnode
# Same interface name inside every namespace, as on a homogeneous cluster, so one
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME works on all hosts.
NODE_IFACE=eth0
MAX_HOSTS=32
SSH_CONFIG=${HOME}/.ssh/config
BEGIN_MARK="# >>> deepseek-ds testcluster (launch/testcluster.sh) >>>"
END_MARK="# <<< deepseek-ds testcluster <<<"

die() { echo "testcluster: $*" >&2; exit 1; }
host_name() { echo "${HOST_PREFIX}$1"; }
host_addr() { echo "${SUBNET}.$((10 + $1))"; }

require_tools() {
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces, bridge, sshd)"
    command -v ip >/dev/null || die "ip not found: run launch/install_test_deps.sh"
    [[ -x /usr/sbin/sshd ]] || die "/usr/sbin/sshd not found: run launch/install_test_deps.sh"
    command -v ssh-keygen >/dev/null || die "ssh-keygen not found: run launch/install_test_deps.sh"
}

# Hosts of the current cluster: the namespaces named like ours (found even if the state dir is gone).
existing_hosts() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${HOST_PREFIX}[0-9]+$" | sort -V || true
}

sshd_pid() {  # prints the pid of host $1's listening sshd if it is running
    local pidfile pid
    pidfile="$STATE_DIR/$(host_name "$1")/sshd.pid"
    [[ -f $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/comm && $(</proc/"$pid"/comm) == sshd ]] && ! exited "$pid" || return 1
    echo "$pid"
}

start_sshd() {
    local name; name=$(host_name "$1")
    [[ -f $STATE_DIR/$name/sshd_config ]] || die "no host $1 (run: $0 up N)"
    if sshd_pid "$1" >/dev/null; then return 0; fi
    mkdir -p /run/sshd  # sshd's privilege-separation directory
    # `ip netns exec` also bind-mounts /etc/netns/$name/hosts over /etc/hosts for sshd and its sessions.
    ip netns exec "$name" /usr/sbin/sshd -f "$STATE_DIR/$name/sshd_config" -E "$STATE_DIR/$name/sshd.log"
    for _ in $(seq 50); do sshd_pid "$1" >/dev/null && return 0; sleep 0.1; done
    die "sshd of $name did not start; see $STATE_DIR/$name/sshd.log"
}

exited() {  # true once pid $1 is gone or a zombie (PID 1 here may take a while to reap it)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    [[ $(awk '{print $1}' <<<"${stat##*)}") == Z ]]  # the state follows "(comm)"
}

stop_sshd() {
    local pid
    if pid=$(sshd_pid "$1"); then
        kill "$pid"
        for _ in $(seq 50); do exited "$pid" && return 0; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
}

remove_ssh_config_block() {
    [[ -f $SSH_CONFIG ]] || return 0
    awk -v b="$BEGIN_MARK" -v e="$END_MARK" '$0==b{skip=1} !skip{print} $0==e{skip=0}' \
        "$SSH_CONFIG" >"$SSH_CONFIG.tmp"
    cat "$SSH_CONFIG.tmp" >"$SSH_CONFIG" && rm -f "$SSH_CONFIG.tmp"
    [[ -s $SSH_CONFIG ]] || rm -f "$SSH_CONFIG"  # it held nothing but our block
}

cmd_down() {
    local name pids
    for name in $(existing_hosts); do
        # Everything running in the namespace (its sshd, ssh sessions, ranks of an aborted job) was
        # started through this cluster; it has to go before the namespace can really disappear.
        pids=$(ip netns pids "$name" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            # shellcheck disable=SC2086  # one pid per word
            kill -9 $pids 2>/dev/null || true
        fi
        ip netns del "$name" 2>/dev/null || true
        rm -rf "/etc/netns/$name"
    done
    # veth peers vanish with their namespace; the host-side ends and the bridge are ours to delete.
    for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^dsveth[0-9]+$" || true); do
        ip link del "$dev" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if command -v iptables >/dev/null; then
        while iptables -D "${FORWARD_ACCEPT[@]}" 2>/dev/null; do :; done
    fi
    rmdir /etc/netns 2>/dev/null || true  # kept if other namespaces still use it
    remove_ssh_config_block
    rmdir "$(dirname "$SSH_CONFIG")" 2>/dev/null || true  # kept unless `up` left it empty
    rm -rf "$STATE_DIR"
}

cmd_up() {
    local n=${1:-}
    if ! [[ $n =~ ^[0-9]+$ ]] || ((n < 1 || n > MAX_HOSTS)); then
        die "usage: $0 up N  (1 <= N <= $MAX_HOSTS)"
    fi
    cmd_down
    mkdir -p "$STATE_DIR" && chmod 700 "$STATE_DIR"

    ip link add "$BRIDGE" type bridge
    # The bridge's address lets this (root) namespace, where the launcher and pdsh run, reach the hosts.
    ip addr add "${SUBNET}.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # On a machine running docker, frames crossing the bridge go through iptables' FORWARD chain (bridge netfilter),
    # whose policy docker sets to DROP: the hosts would not reach each other. Let our bridge's own traffic through.
    if [[ $(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null) == 1 ]] && command -v iptables >/dev/null; then
        iptables -I "${FORWARD_ACCEPT[@]}"
    fi

    ssh-keygen -q -t ed25519 -N "" -C deepseek-ds-testcluster -f "$STATE_DIR/id_ed25519"
    cp "$STATE_DIR/id_ed25519.pub" "$STATE_DIR/authorized_keys"
    : >"$STATE_DIR/known_hosts"
    : >"$STATE_DIR/hostfile"

    # Without PAM, sshd refuses even key logins to a locked account ('!' password, as root is on
    # some distributions); PAM's account check allows them.
    local use_pam=no
    [[ $(getent shadow root | cut -d: -f2) == '!'* ]] && use_pam=yes

    local hosts_file="$STATE_DIR/etc_hosts" i name addr
    cp /etc/hosts "$hosts_file"
    for ((i = 0; i < n; i++)); do echo "$(host_addr "$i") $(host_name "$i")" >>"$hosts_file"; done

    local ssh_block="$BEGIN_MARK"$'\n'
    for ((i = 0; i < n; i++)); do
        name=$(host_name "$i")
        addr=$(host_addr "$i")
        ip netns add "$name"
        ip link add "dsveth$i" type veth peer name "$NODE_IFACE" netns "$name"
        ip link set "dsveth$i" master "$BRIDGE" up
        ip -n "$name" addr add "$addr/24" dev "$NODE_IFACE"
        ip -n "$name" link set "$NODE_IFACE" up
        ip -n "$name" link set lo up
        mkdir -p "/etc/netns/$name"
        cp "$hosts_file" "/etc/netns/$name/hosts"

        mkdir -p "$STATE_DIR/$name"
        ssh-keygen -q -t ed25519 -N "" -C "$name" -f "$STATE_DIR/$name/ssh_host_ed25519_key"
        echo "$name,$addr $(cut -d' ' -f1-2 "$STATE_DIR/$name/ssh_host_ed25519_key.pub")" >>"$STATE_DIR/known_hosts"
        cat >"$STATE_DIR/$name/sshd_config" <<EOF
ListenAddress $addr
HostKey $STATE_DIR/$name/ssh_host_ed25519_key
PidFile $STATE_DIR/$name/sshd.pid
AuthorizedKeysFile $STATE_DIR/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM $use_pam
PrintMotd no
# pdsh and preflight open one connection per host at once, tests several in a row.
MaxStartups 64:30:128
EOF
        ssh_block+="Host $name"$'\n'"    HostName $addr"$'\n'
        echo "$name slots=1" >>"$STATE_DIR/hostfile"
    done
    ssh_block+="Host ${HOST_PREFIX}*
    User root
    IdentityFile $STATE_DIR/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE_DIR/known_hosts
    StrictHostKeyChecking yes
    LogLevel ERROR
$END_MARK"

    # Prepended: ssh takes the first value it finds for each option, so ours win for our hosts,
    # and a trailing `Host`/`Match` block in the user's file cannot swallow them.
    mkdir -p "$(dirname "$SSH_CONFIG")" && chmod 700 "$(dirname "$SSH_CONFIG")"
    touch "$SSH_CONFIG"
    { echo "$ssh_block"; cat "$SSH_CONFIG"; } >"$SSH_CONFIG.tmp"
    cat "$SSH_CONFIG.tmp" >"$SSH_CONFIG" && rm -f "$SSH_CONFIG.tmp"
    chmod 600 "$SSH_CONFIG"

    # What DeepSpeed must export on every host (via .deepspeed_env): gloo and NCCL use the cluster
    # interface instead of the shared host name, which resolves to a loopback address.
    cat >"$STATE_DIR/deepspeed_env" <<EOF
GLOO_SOCKET_IFNAME=$NODE_IFACE
NCCL_SOCKET_IFNAME=$NODE_IFACE
EOF

    for ((i = 0; i < n; i++)); do start_sshd "$i"; done
    for ((i = 0; i < n; i++)); do
        ssh -o BatchMode=yes -o ConnectTimeout=5 "$(host_name "$i")" true ||
            die "ssh $(host_name "$i") failed; see $STATE_DIR/$(host_name "$i")/sshd.log"
    done
    cmd_status
}

cmd_status() {
    [[ -f $STATE_DIR/hostfile ]] || { echo "testcluster: down"; return 0; }
    echo "hostfile: $STATE_DIR/hostfile"
    echo "env: $STATE_DIR/deepspeed_env"
    echo "master_addr: $(host_addr 0)"
    local name i
    for name in $(existing_hosts); do
        i=${name#"$HOST_PREFIX"}
        if sshd_pid "$i" >/dev/null; then echo "$name $(host_addr "$i") sshd=up"; else echo "$name $(host_addr "$i") sshd=down"; fi
    done
}

require_tools
case ${1:-} in
    up) cmd_up "${2:-}" ;;
    down) cmd_down; echo "testcluster: down" ;;
    status) cmd_status ;;
    sshd-stop) stop_sshd "${2:?usage: $0 sshd-stop I}" ;;
    sshd-start) start_sshd "${2:?usage: $0 sshd-start I}" ;;
    *) die "usage: $0 up N | down | status | sshd-stop I | sshd-start I" ;;
esac
