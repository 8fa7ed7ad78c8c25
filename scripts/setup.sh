#!/usr/bin/env bash
# Sets up everything from nothing: a virtual environment in .venv with torch, the
# build tools and pytest, then builds and installs torch-tweak into it.
# Sourced by example.sh and test.sh; safe to run again (it only adds what is missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    # A machine whose Python already has torch (a GPU build, say) keeps using it: the new
    # environment sees that Python's packages, also when that Python is itself a venv.
    if "$PYTHON" -c "import torch" 2>/dev/null; then
        site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        "$PYTHON" -c "import site, sys; print('\n'.join(p for p in site.getsitepackages() + [site.getusersitepackages()] if p))" > "$site/_parent_site.pth"
    fi
fi
VPY=.venv/bin/python

need=()
"$VPY" -c "import torch" 2>/dev/null || need+=("torch==2.13.0")  # the CPU build; never an unpinned torch
"$VPY" -c "import pytest" 2>/dev/null || need+=("pytest")
"$VPY" -c "import pytest_timeout" 2>/dev/null || need+=("pytest-timeout")  # a hung test fails (test.sh)
"$VPY" -c "import safetensors" 2>/dev/null || need+=("safetensors>=0.4")  # tt.save / tt.load
"$VPY" -c "import scikit_build_core" 2>/dev/null || need+=("scikit-build-core>=0.9")
command -v cmake >/dev/null 2>&1 || "$VPY" -c "import cmake" 2>/dev/null || need+=("cmake")
command -v ninja >/dev/null 2>&1 || "$VPY" -c "import ninja" 2>/dev/null || need+=("ninja")
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}"
    "$VPY" -m pip install -q "${need[@]}"
fi
# Optional: the extras of pyproject.toml (each optional backend's, torchao and plot), so their backends and
# tests run. Where they cannot be installed (no network), torch-tweak works without them and their tests skip.
# Every extra but test, plot and torchao (below) is read from pyproject.toml: one whose packages are not
# all installed is installed whole, so a new backend's extra needs no line here.
optional=()
while IFS= read -r requirement; do
    [ -n "$requirement" ] && optional+=("$requirement")
done < <("$VPY" - <<'PY'
import importlib.metadata, re
section = open("pyproject.toml").read().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
for extra, listed in re.findall(r'^([A-Za-z][\w-]*)\s*=\s*\[([^\]]*)\]', section, re.M):
    requirements = re.findall(r'"([^"]+)"', listed)
    if extra in ("test", "plot", "torchao"):
        continue
    try:
        for requirement in requirements:
            importlib.metadata.version(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])
    except importlib.metadata.PackageNotFoundError:
        print("\n".join(requirements))
PY
)
# torchao: on a CPU build of torch, 0.13.0, which imports without a line (0.16 to 0.18 log the CUDA
# kernels they cannot load there, an incompatible-torch notice or torch's deprecation of their Enum
# constants at every import, transformers' too); elsewhere 0.18, built for torch 2.11 and later (an
# older torch goes without).
if ! "$VPY" -c "import torchao" 2>/dev/null; then
    if "$VPY" -c "import sys, torch; sys.exit(torch.version.cuda is not None or torch.version.hip is not None)" 2>/dev/null; then
        optional+=("torchao==0.13.0")
    elif "$VPY" -c "import sys, torch; v = torch.__version__.split('.'); sys.exit((int(v[0]), int(v[1])) < (2, 11))" 2>/dev/null; then
        optional+=("torchao==0.18.0")
    fi
fi
"$VPY" -c "import matplotlib" 2>/dev/null || optional+=("matplotlib>=3.5")
# transformers: its models are tested end to end (built from configs, nothing downloaded)
"$VPY" -c "import transformers" 2>/dev/null || optional+=("transformers==5.24.0")
# accelerate: transformers' tensor parallelism (tp_plan="auto") needs it; tests/test_distributed.py tunes one
"$VPY" -c "import accelerate" 2>/dev/null || optional+=("accelerate==1.15.0")
# Triton, next to a CPU torch only (a CUDA torch brings its own): its interpreter runs the fused decode
# step's kernels in tests/test_fused_*.py; 3.6, the release the GPU machines run, so the kernels are checked
# against the Triton they run on
if ! "$VPY" -c "import triton" 2>/dev/null && "$VPY" -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
    optional+=("triton==3.6.0")
fi
if [ ${#optional[@]} -gt 0 ]; then
    echo "setup: installing the optional ${optional[*]}"
    if [ "${CI:-}" = true ]; then
        "$VPY" -m pip install -q "${optional[@]}"  # CI runs every backend's tests: no skipping there
    else
        "$VPY" -m pip install -q "${optional[@]}" || echo "setup: could not install ${optional[*]}; going on without them"
    fi
fi
export PATH="$PWD/.venv/bin:$PATH"

echo "setup: building torch-tweak"
"$VPY" -m pip install -q --no-build-isolation --no-deps . >/dev/null
"$VPY" -c "import torch, torch_tweak; print('setup: torch', torch.__version__, '| torch-tweak', torch_tweak.__version__)"
