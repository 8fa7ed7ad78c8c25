#!/usr/bin/env bash
# One GPU start measures what issues 56 and 57 ask, within 9 minutes: the package installed, the
# issue-56 generate() calls (bench/generate_bench.py --calls: llama1b greedy batch 1 with batches 4
# and 8 served from that tuning, qwen05b greedy, llama1b chat; 255 s), then issue 57's stream of
# request shapes never seen at tuning (bench/serving_bench.py --fresh; 190 s). Each script keeps
# its run file up to date as it goes, so a run stopped at its limit keeps what it measured.
#     OUT=folder TT_BENCH_COMMIT=<commit> bash bench/gpu_issues_56_57.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/results/runs}
mkdir -p "$OUT"
python -m pip install -q --no-build-isolation --no-deps . >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
commit=${TT_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
card=$(python -c "import torch; print(torch.cuda.get_device_name().replace('NVIDIA ', '').split()[0].lower())")
echo "gpu: $card, commit $commit"
timeout 290 python bench/generate_bench.py --calls --dtypes bf16 --prompts 32 --budget 255 \
    --rows "llama1b:greedy:1:4,8;qwen05b:greedy:1;llama1b:chat:1" \
    --json "$OUT/generate-calls-56-$commit-$card.json" >"$OUT/generate-56.log" 2>&1
echo "generate: exit $?"; tail -5 "$OUT/generate-56.log"
timeout 215 python bench/serving_bench.py --fresh --budget 190 \
    --json "$OUT/serving-fresh-$commit-$card.json" >"$OUT/serving-fresh.log" 2>&1
echo "serving: exit $?"; tail -5 "$OUT/serving-fresh.log"
