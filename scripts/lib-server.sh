# Sourced by scripts that need a throwaway `tarn serve`: start_tarn DATA_DIR [serve flags...]
# starts $TARN_BIN (default target/release/tarn) on ephemeral ports (gRPC on the Unix socket $TARN_SOCKET if set),
# waits until it announces its addresses, and sets TARN_PID, TARN_ADDR (http://host:port or
# unix:/path, exported for the CLI) and TARN_METRICS. stop_tarn sends
# SIGTERM and waits. The caller builds the binary first (cargo build --release -p tarn).

start_tarn() {
    local dir="$1"
    shift
    mkdir -p "$dir"
    local listen=127.0.0.1:0
    [[ -n ${TARN_SOCKET:-} ]] && listen="unix:$TARN_SOCKET"
    "${TARN_BIN:-target/release/tarn}" serve --data-dir "$dir" --listen "$listen" --metrics-listen 127.0.0.1:0 \
        "$@" >"$dir/serve.out" 2>"$dir/serve.err" &
    TARN_PID=$!
    local i
    for i in $(seq 1 200); do
        if grep -q '^tarn: metrics listening on ' "$dir/serve.out" 2>/dev/null &&
            grep -q '^tarn: gRPC listening on ' "$dir/serve.out"; then
            TARN_ADDR="$(sed -n 's/^tarn: gRPC listening on //p' "$dir/serve.out")"
            [[ $TARN_ADDR == unix:* ]] || TARN_ADDR="http://$TARN_ADDR"
            TARN_METRICS="$(sed -n 's/^tarn: metrics listening on //p' "$dir/serve.out")"
            export TARN_ADDR
            return 0
        fi
        if ! kill -0 "$TARN_PID" 2>/dev/null; then
            echo "tarn serve exited early:" >&2
            cat "$dir/serve.err" >&2
            return 1
        fi
        sleep 0.05
    done
    echo "tarn serve did not announce its address in 10 s" >&2
    return 1
}

stop_tarn() {
    if [[ -n "${TARN_PID:-}" ]] && kill -0 "$TARN_PID" 2>/dev/null; then
        kill -TERM "$TARN_PID"
        wait "$TARN_PID" || true
    fi
    TARN_PID=
}
