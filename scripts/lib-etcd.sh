# Sourced by scripts (and by rs/cluster's etcd tests) that need a throwaway etcd for cluster mode.
#
#   ensure_etcd          installs Debian's etcd-server when `etcd` is not on PATH (as root, or
#                        with sudo); returns 1, saying why, when that is impossible.
#   start_etcd DIR       starts a one-member etcd with its data (and its log, DIR/etcd.log) in
#                        DIR, on free loopback ports (or on ETCD_CLIENT_PORT and ETCD_PEER_PORT
#                        when set, to restart one on its old ports), waits until /health answers,
#                        and sets ETCD_PID, ETCD_CLIENT_PORT, ETCD_PEER_PORT and ETCD_ENDPOINT
#                        (http://127.0.0.1:PORT, exported).
#   stop_etcd            sends SIGTERM to ETCD_PID and waits for it.
#
# Debian's etcd-server 3.4 ships the server as /usr/bin/etcd (etcdctl is in etcd-client, which
# this does not need). On arm64 and other non-amd64 architectures etcd 3.4 refuses to start
# unless ETCD_UNSUPPORTED_ARCH names the architecture; start_etcd sets it there.

ensure_etcd() {
    command -v etcd >/dev/null 2>&1 && return 0
    local sudo=
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            echo "ensure_etcd: etcd is not installed and installing it needs root (apt-get install etcd-server)" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "ensure_etcd: etcd is not installed and there is no apt-get to install it with" >&2
        return 1
    fi
    echo "ensure_etcd: installing Debian's etcd-server (needed by cluster mode's tests)" >&2
    # The package's maintainer scripts may try to start a system etcd on the default ports:
    # policy-rc.d (when none exists) tells invoke-rc.d not to, as in a container.
    local policy=/usr/sbin/policy-rc.d created_policy=
    if [[ ! -e $policy && -z $sudo ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q etcd-server >/dev/null 2>&1 ||
        { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q etcd-server >/dev/null 2>&1; }
    [[ -n $created_policy ]] && rm -f "$policy"
    if ! command -v etcd >/dev/null 2>&1; then
        echo "ensure_etcd: apt-get could not install etcd-server" >&2
        return 1
    fi
}

# Prints a TCP port that nothing listens on at 127.0.0.1 (the kernel's choice; it is free again
# once printed, and the race with other processes is accepted in tests).
_etcd_free_port() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
        return
    fi
    local port
    while :; do
        port=$((20000 + RANDOM % 30000))
        # A port that refuses a connection is taken as free.
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return
        fi
    done
}

start_etcd() {
    local dir="$1"
    mkdir -p "$dir"
    command -v etcd >/dev/null 2>&1 || { echo "start_etcd: etcd is not installed (ensure_etcd)" >&2; return 1; }
    ETCD_CLIENT_PORT=${ETCD_CLIENT_PORT:-$(_etcd_free_port)}
    ETCD_PEER_PORT=${ETCD_PEER_PORT:-$(_etcd_free_port)}
    while [[ $ETCD_PEER_PORT == "$ETCD_CLIENT_PORT" ]]; do ETCD_PEER_PORT=$(_etcd_free_port); done
    case "$(uname -m)" in
        x86_64 | amd64) ;;
        aarch64 | arm64) export ETCD_UNSUPPORTED_ARCH=arm64 ;;
        *) export ETCD_UNSUPPORTED_ARCH="$(uname -m)" ;;
    esac
    local client="http://127.0.0.1:$ETCD_CLIENT_PORT" peer="http://127.0.0.1:$ETCD_PEER_PORT"
    # etcd reads ETCD_* variables as flags: the endpoint exported by an earlier start is none.
    env -u ETCD_ENDPOINT etcd --name tarn-test --data-dir "$dir/data" \
        --listen-client-urls "$client" --advertise-client-urls "$client" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
        --initial-cluster "tarn-test=$peer" --initial-cluster-state new \
        --logger zap --log-level warn >>"$dir/etcd.log" 2>&1 &
    ETCD_PID=$!
    ETCD_ENDPOINT=$client
    export ETCD_ENDPOINT
    local i
    for i in $(seq 1 200); do
        if curl -fsS --max-time 1 "$client/health" 2>/dev/null | grep -q '"health":"true"'; then
            return 0
        fi
        if ! kill -0 "$ETCD_PID" 2>/dev/null; then
            echo "start_etcd: etcd exited early; its log ($dir/etcd.log):" >&2
            tail -n 20 "$dir/etcd.log" >&2
            return 1
        fi
        sleep 0.05
    done
    echo "start_etcd: etcd did not answer /health in 10 s; its log ($dir/etcd.log):" >&2
    tail -n 20 "$dir/etcd.log" >&2
    return 1
}

stop_etcd() {
    if [[ -n ${ETCD_PID:-} ]] && kill -0 "$ETCD_PID" 2>/dev/null; then
        kill -TERM "$ETCD_PID"
        wait "$ETCD_PID" 2>/dev/null || true
    fi
    ETCD_PID=
}
