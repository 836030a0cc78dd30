# Sourced by benchmark scripts that compare against PostgreSQL 15 (Debian package, installed if
# missing): pg_start DIR starts a throwaway cluster under DIR (on the same disk as tarn's data
# when DIR is under target/), owned by the postgres user (PostgreSQL refuses to run as root),
# with fsync, synchronous_commit and full_page_writes on, on a random port; it sets PG_DIR and
# PG_PORT. pg_stop stops it. pg_insert_table creates the table and the pgbench script of the
# insert comparison: one INSERT of a 128-float real[] row per transaction (there is no pgvector
# package in the apt mirror here). pg_insert_run CLIENTS TOTAL [pgbench flags] runs TOTAL of
# those inserts from CLIENTS connections (made before the clock starts), then a CHECKPOINT
# (untimed), and prints the tx/s.
pg_bin=/usr/lib/postgresql/15/bin

as_pg() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

pg_start() {
    PG_DIR="$1"
    if [[ ! -x "$pg_bin/postgres" ]]; then
        echo "installing postgresql-15 from Debian packages" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 >/dev/null
    fi
    mkdir -p "$PG_DIR"
    if [[ $(id -u) == 0 ]]; then chown -R postgres "$PG_DIR"; fi
    as_pg "$pg_bin/initdb" -D "$PG_DIR/data" --auth=trust -U postgres >/dev/null
    PG_PORT=$((20000 + RANDOM % 10000))
    as_pg "$pg_bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w start -o \
        "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c fsync=on -c synchronous_commit=on -c full_page_writes=on -c max_connections=300" >/dev/null
}

pg_stop() { as_pg "$pg_bin/pg_ctl" -D "$PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true; }

psql_() { psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres "$@"; }

pg_insert_table() {
    # Without autovacuum on the table: its insert threshold is 1,000 rows, so a vacuum started at
    # the end of one run and ran during the next one (tarn's, as often as not).
    psql_ -c "CREATE TABLE items (id bigserial PRIMARY KEY, embedding real[] NOT NULL) WITH (autovacuum_enabled = off)"
    local vector
    vector="$(python3 -c "import random; random.seed(1); print('{' + ','.join(f'{random.uniform(-1,1):.6f}' for _ in range(128)) + '}')")"
    echo "INSERT INTO items (embedding) VALUES ('$vector');" >"$PG_DIR/insert.sql"
}

pg_insert_run() {
    local c=$1 total=$2
    shift 2
    local per=$(((total + c - 1) / c))
    # -C not given: connections are made before the clock starts, as tarn's clients are.
    (cd "$PG_DIR" && pgbench -n -h 127.0.0.1 -p "$PG_PORT" -U postgres -c "$c" -j 2 -t "$per" \
        -f insert.sql "$@" postgres >"$PG_DIR/pgbench.out" 2>&1)
    # The run's dirty pages are written out now, not by the checkpointer during a later run.
    psql_ -c CHECKPOINT
    sed -n 's/^tps = \([0-9.]*\) (without initial connection time)/\1/p' "$PG_DIR/pgbench.out"
}
