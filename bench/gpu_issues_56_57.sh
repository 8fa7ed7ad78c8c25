#!/usr/bin/env bash
# One GPU start measures what issues 55 to 57 ask, within 9 minutes: the package installed, the GPU
# suite (tests/gpu; SUITE=0 leaves it out), the issue-56 generate() calls (bench/generate_bench.py
# --calls; ROWS, default llama1b greedy batch 1 with batches 4 and 8 served from that tuning, then
# llama1b chat; GEN_BUDGET s), then issue 57's stream of request shapes never seen at tuning
# (bench/serving_bench.py --fresh; SERVE_BUDGET s). Each script keeps its run file up to date as it
# goes, so a run stopped at its limit keeps what it measured.
#     OUT=folder TT_BENCH_COMMIT=<commit> bash bench/gpu_issues_56_57.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/results/runs}
ROWS=${ROWS:-"llama1b:greedy:1:4,8;llama1b:chat:1"}
GEN_BUDGET=${GEN_BUDGET:-240}
SERVE_BUDGET=${SERVE_BUDGET:-150}
mkdir -p "$OUT"
python -m pip install -q --no-build-isolation --no-deps . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
commit=${TT_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
card=$(python -c "import torch; print(torch.cuda.get_device_name().replace('NVIDIA ', '').split()[0].lower())")
echo "gpu: $card, commit $commit"
if [ "${SUITE:-1}" != 0 ]; then
    timeout 200 python -m pytest -q --timeout 120 -p no:cacheprovider tests/gpu -rfE --show-capture=no --tb=short \
        --junitxml="$OUT/gpu-suite-$commit-$card.xml" >"$OUT/gpu-suite.log" 2>&1
    echo "suite: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-suite.log" | tail -8
fi
timeout $((GEN_BUDGET + 35)) python bench/generate_bench.py --calls --dtypes bf16 --prompts 32 --budget "$GEN_BUDGET" \
    --rows "$ROWS" --json "$OUT/generate-calls-56-$commit-$card.json" >"$OUT/generate-56.log" 2>&1
echo "generate: exit $?"; grep -E "^\| " "$OUT/generate-56.log" | tail -6
timeout $((SERVE_BUDGET + 25)) python bench/serving_bench.py --fresh --budget "$SERVE_BUDGET" \
    --json "$OUT/serving-fresh-$commit-$card.json" >"$OUT/serving-fresh.log" 2>&1
echo "serving: exit $?"; grep -v DEBUG "$OUT/serving-fresh.log" | tail -12
