"""A real `tarn serve` for the tests: TARN_TEST_ADDR names a running server, otherwise the binary
at TARN_BIN (default: the repository's target/debug/tarn, which `cargo test` builds) is started on
an ephemeral port with a temporary data directory."""

import contextlib
import os
import signal
import subprocess
import tempfile
import time

import pytest

from tarn_client import Client

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@contextlib.contextmanager
def tarn_server(listen):
    """Starts the binary with gRPC on `listen` (host:port or unix:/path) and a temporary data
    directory; yields the address it announces; stops it with SIGTERM and checks the exit."""
    binary = os.environ.get("TARN_BIN", os.path.join(REPO, "target", "debug", "tarn"))
    if not os.path.exists(binary):
        pytest.fail(f"no tarn binary at {binary}: run `cargo build -p tarn` or set TARN_BIN")
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen(
            [binary, "serve", "--data-dir", data, "--listen", listen,
             "--metrics-listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE, text=True,
        )
        grpc_addr = metrics_addr = None
        deadline = time.time() + 30
        while time.time() < deadline and not (grpc_addr and metrics_addr):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("tarn: gRPC listening on "):
                grpc_addr = line.split()[-1]
            if line.startswith("tarn: metrics listening on "):
                metrics_addr = line.split()[-1]
        if grpc_addr is None:
            proc.kill()
            pytest.fail("tarn serve did not announce its address")
        try:
            yield grpc_addr
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, "tarn serve did not exit cleanly on SIGTERM"


@pytest.fixture(scope="session")
def address():
    if os.environ.get("TARN_TEST_ADDR"):
        yield os.environ["TARN_TEST_ADDR"]
        return
    with tarn_server("127.0.0.1:0") as grpc_addr:
        yield grpc_addr


@pytest.fixture()
def unix_address(tmp_path):
    """A server of its own on a Unix socket (`unix:/path`)."""
    with tarn_server(f"unix:{tmp_path}/tarn.sock") as grpc_addr:
        yield grpc_addr


@pytest.fixture()
def client(address):
    with Client(address) as c:
        c.wait_ready(timeout=10)
        yield c
