#!/usr/bin/env bash
# The one script to run on a lent GPU machine (<= 8 minutes, one GPU is enough), from a fresh clone:
#   1. the README's install command (skipped when .venv exists),
#   2. the CUDA tests (tests/test_cuda.py; skipped, saying so, where torch sees no GPU),
#   3. bench/gpu.py: a trainer with a Qwen2.5-0.5B-shaped random model in bf16 on the GPU, fed by CPU samplers,
#      printing step time, tokens/s, busy fraction, verification cost, version write+publish time and peak GPU
#      memory per parameter, written to bench/results/gpu.txt.
# On a machine without a GPU: bench/gpu.sh --device cpu (a small dry run of the same path; gpu_cpu_dryrun.txt).
# A CUDA machine needs pytorch.org's CUDA build of torch 2.13.0 in .venv (README, "Training on a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'
fi
PY=.venv/bin/python
if [ "$DEVICE" = cuda ] && ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "bench/gpu.sh: torch sees no CUDA device (install pytorch.org's CUDA build of torch 2.13.0, or pass --device cpu)" >&2
  exit 2
fi
echo "== CUDA tests"
timeout 180 $PY -m pytest -q -rs tests/test_cuda.py
echo "== trainer on $DEVICE fed by CPU samplers"
timeout 420 $PY bench/gpu.py --device "$DEVICE" "${ARGS[@]+"${ARGS[@]}"}"
