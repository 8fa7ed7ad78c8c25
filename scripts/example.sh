#!/usr/bin/env bash
# The main job: set up from nothing, then tweak examples/Tweak (on the GPU when there is one).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/python examples/Tweak/main.py "$@"
