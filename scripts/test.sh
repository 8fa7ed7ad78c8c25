#!/usr/bin/env bash
# Every test: set up from nothing, the engine's C tests (plain and under ASan+UBSan),
# then the Python tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

for variant in plain asan; do
    flags=()
    [ "$variant" = asan ] && flags=(-DTW_SANITIZE=ON -DTW_DEBUG=ON)
    echo "test: engine C tests ($variant)"
    cmake -S engine -B "build/engine-$variant" -DTW_BUILD_TESTS=ON "${flags[@]}" >/dev/null
    cmake --build "build/engine-$variant" >/dev/null
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 ctest --test-dir "build/engine-$variant" --output-on-failure
done

echo "test: Python tests"
# -rs: every skipped test says why (no GPU here, a package that could not be installed...)
# --timeout: a test still running after 10 minutes (the slowest take about one) fails with every
# thread's stack, and the suite goes on, instead of a hang taking CI's whole time
.venv/bin/python -m pytest -q -rs --timeout 600 "$@"
