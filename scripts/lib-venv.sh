# Sourced by the scripts that compare tarn with Python libraries: bench_venv installs hnswlib
# 0.8.0 (built from source by pip, so with -march=native), numpy and matplotlib from PyPI into
# the virtualenv $TARN_BENCH_VENV (default target/venv-bench), creating it if needed, and sets
# BENCH_PYTHON to its interpreter.
bench_venv() {
    local venv="${TARN_BENCH_VENV:-target/venv-bench}"
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet 'hnswlib==0.8.0' 'numpy<3' 'matplotlib<4'
    BENCH_PYTHON="$venv/bin/python"
    BENCH_VENV="$venv"
}
