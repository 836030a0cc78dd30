# Sourced by the Docker end-to-end scripts: `find_compose NAME` exits 0 with `NAME: SKIPPED (...)`
# when no Docker engine answers or no Compose tool is installed, and otherwise sets `compose` to
# the command to run (`docker compose` or `docker-compose`).
find_compose() {
    local name="$1"
    if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
        echo "$name: SKIPPED (no Docker engine)"
        exit 0
    fi
    if docker compose version >/dev/null 2>&1; then
        compose=(docker compose)
    elif command -v docker-compose >/dev/null; then
        compose=(docker-compose)
    else
        echo "$name: SKIPPED (no docker compose / docker-compose)"
        exit 0
    fi
}
