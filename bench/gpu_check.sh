#!/usr/bin/env bash
# GPU check: the CUDA side of the benchmarks, in under 4 minutes, for a machine with a CUDA device.
#
#   bash bench/gpu_check.sh            # uses $PYTHON, else .venv/bin/python, else python3
#
# Runs bench/gpu_nanwatch.py (nanwatch overhead and correctness on CUDA), bench/gpu_memory.py
# (%%cudamem on CUDA), bench/gpu_repro.py (%%repro: atomics found as 'nondeterministic_op', a
# deterministic GPT step identical and run once, its cost) and bench/gpu_grads.py (record_gradients
# next to the foreach-norm anchor on both models, and its host synchronisations) and bench/gpu_profile.py
# (%%profile: the sync verdict on a step reading .item(), kernels on lines, its cost), each under its own
# time limit and all within one budget of 218 s, and prints what each printed. With 2 GPUs or more it
# then runs bench/gpu_ranks.py under torchrun on NCCL (skipped, with a message, on fewer). The repository
# root is put on PYTHONPATH so the package needs no install on a machine that already has torch.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'PY' || { echo "gpu_check: $PY has no torch with a CUDA device; nothing to check (set PYTHON=...)" >&2; exit 2; }
import sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, python {sys.version.split()[0]}")
PY

status=0
# Each script has its own limit; together they may not pass BUDGET, so the whole check ends within
# 4 minutes: a script gets what is left of it, and is skipped when less than 10 s is left.
BUDGET=218
for entry in "gpu_nanwatch.py 65" "gpu_memory.py 80" "gpu_repro.py 30" "gpu_grads.py 40" "gpu_profile.py 40"; do
    set -- $entry
    script="bench/$1" limit="$2"
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo "===== $script: SKIPPED, ${left}s left of the ${BUDGET}s budget"
        status=1
        continue
    fi
    [ "$left" -lt "$limit" ] && limit="$left"
    echo "===== $script (limit ${limit}s) ====="
    if ! [ -f "$script" ]; then
        echo "gpu_check: $script is missing"
        status=1
        continue
    fi
    start=$SECONDS
    timeout --kill-after=5 "$limit" "$PY" "$script"
    rc=$?
    case "$rc" in
        0) echo "----- $script: ok in $((SECONDS - start))s" ;;
        124|137) echo "----- $script: TIMED OUT after ${limit}s"; status=1 ;;
        *) echo "----- $script: FAILED with exit code $rc"; status=1 ;;
    esac
done

# NCCL across ranks (bench/gpu_ranks.py): DDP on 2 GPUs under torchrun -m torch_nbdebug nanwatch, and the
# merged report must name the rank, step and op of the birth and who sent it into the all-reduce.
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -lt 2 ]; then
    echo "===== bench/gpu_ranks.py: skipped, NCCL across ranks needs 2 GPUs and this machine has $gpus"
else
    out="$(mktemp -d)"
    echo "===== bench/gpu_ranks.py (NCCL, 2 ranks, limit 90s) ====="
    timeout --kill-after=5 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m torch_nbdebug nanwatch --out "$out" bench/gpu_ranks.py > "$out/torchrun.log" 2>&1
    rc=$?
    tail -n 5 "$out/torchrun.log"
    if [ "$rc" -ne 0 ] || ! "$PY" bench/gpu_ranks.py --check "$out"; then
        echo "----- bench/gpu_ranks.py: FAILED (torchrun exit $rc; log and report in $out)"
        status=1
    else
        echo "----- bench/gpu_ranks.py: ok"
    fi
fi
exit "$status"
