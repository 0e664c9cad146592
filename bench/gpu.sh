#!/usr/bin/env bash
# The bundled trainer's figures on one GPU, in under 8 minutes on one H200 (a benchmark, not a
# test): tokens/s per GPU, model TFLOP/s, MFU and peak memory for the 1B model at sequence length
# 4096 in bf16, eager and with each block compiled; the async checkpoint stall (a real
# device-to-host copy) against a synchronous save; the data-wait share of step time.
#
#   bench/gpu.sh            # on a GPU machine, from the repository root; JSON lines to $OUT if set
#   bench/gpu.sh --tiny     # anywhere: CPU, tiny model, seconds (checks that the script works)
#
# Extra arguments go to bench/gpu.py (--model, --seq-len, --batch, --micro, --steps, --ac,
# --no-compile). Each phase is bounded so that one slow phase cannot cost the others: the eager
# phase and checkpoint comparison run first and print as soon as they are done.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/operator:$PWD/trainer_image:$PWD/sdk:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ " $* " != *" --tiny "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
# 7 minutes for the whole run leaves one for start-up and the copy of $OUT.
exec timeout --signal=TERM --kill-after=20 420 python bench/gpu.py "$@"
