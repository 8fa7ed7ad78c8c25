#!/usr/bin/env bash
# The extension's tests under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# TW_SANITIZE=ON is the one switch: the engine and torch_tweak._C are both built
# with -fsanitize=address,undefined (tw_set_warnings in engine/CMakeLists.txt).
# Python itself is not instrumented, so the sanitizer runtimes are preloaded.
# Leak detection is off: the interpreter and torch keep memory until exit.
# The build replaces the extension in .venv; rebuild without the switch after:
#     .venv/bin/python -m pip install -q --no-build-isolation --no-deps .
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/python -m pip install -q --no-build-isolation --no-deps \
    -C cmake.define.TW_SANITIZE=ON -C cmake.define.TW_DEBUG=ON .
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
[ $# -eq 0 ] && set -- tests/test_ext_bindings.py tests/test_ext_dispatch.py tests/test_ext_graph.py
LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
    .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
