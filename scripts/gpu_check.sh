#!/usr/bin/env bash
# The checks that need a GPU, in one call sized for a short lease on a lent CUDA machine
# (its own python3 with a CUDA torch; nothing is installed from the network):
#   1. build the native CPU replay kernel for that interpreter (the engine works without it);
#   2. the CUDA-marked tests (checkpoint equals the live state in every mode, Lightning FSDP,
#      Accelerate FSDP2, DeepSpeed where the package is present);
#   3. examples/bench_scale.py on the GPU at about 1.2 and 3 GB of fp32 weights + AdamW state
#      (modes lazy and auto; interval GOCKPT_GPU_INTERVAL steps, default 30);
#   4. the same at 1.2 GB with a small batch (steps of about 8 ms on an H200, shorter than the
#      D2H copy of the state), where only a multi-step plan hides the copy;
#   5. that small batch with gockpt_o held at K >= 7: the CPU replay's gradient-buffer waits,
#      measured beside the planner's prediction of them;
#   6. ("probe") scripts/gpu_probe_capture.py: each save's stall by phase, a profile of its
#      capture, the costs it was planned with beside the measured ones, and every pinned
#      allocation, for gockpt_o (free K, and K >= 7) and auto on large batches.
# Logs go to $OUT (or /tmp/gockpt-gpu), the tables last on stdout. Each part has its own time
# limit so that one slow part cannot take the others' share of the lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gockpt-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# Defaults sized for two device calls of under 600 s each with the build (about 30-50 s):
# "tests probe" (150 + 3 x 70 s) and "bench small replay" (170 + 150 + 80 s). The small-batch
# part needed more than 110 s on a noisier H200 (2026-11-28: a 2 s torch.save row).
TESTS_S=${GOCKPT_GPU_TESTS_S:-150}
BENCH_S=${GOCKPT_GPU_BENCH_S:-170}
SMALL_S=${GOCKPT_GPU_SMALL_S:-150}
REPLAY_S=${GOCKPT_GPU_REPLAY_S:-80}
PROBE_S=${GOCKPT_GPU_PROBE_S:-70}  # per probe run (three)
# Which parts run (default all but the probe): e.g. GOCKPT_GPU_PARTS="tests probe" in a first
# call, then GOCKPT_GPU_PARTS="bench small replay" on the still-warm machine, so that a failure
# in the tests can be read and fixed before the benchmarks spend the lease.
PARTS=" ${GOCKPT_GPU_PARTS:-tests bench small replay} "
want() { [[ "$PARTS" == *" $1 "* ]]; }

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    lscpu | grep -m1 'Model name'
    nproc
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

# An editable install registers the entry points (Lightning's callbacks factory, the converter's
# frameworks) and builds the kernel; where that interpreter's setuptools is too old for the
# metadata, build the kernel in place and put the checkout on the path instead.
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1; then
    echo "editable install failed (see build.log); building the kernel in place" | tee -a "$OUT/machine.txt"
    "$PY" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1
    export PYTHONPATH=$PWD
fi
"$PY" -c "import gockpt._native as n; print('native kernel:', n.available())" 2>&1 | tee -a "$OUT/machine.txt"

want tests && { timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -m cuda -o addopts= \
    tests/test_cuda.py tests/adapters/test_lightning_fsdp.py tests/adapters/test_accelerate_fsdp2.py \
    tests/adapters/test_lightning_deepspeed.py >"$OUT/tests.log" 2>&1
echo "cuda tests: exit $?" | tee -a "$OUT/machine.txt"; }

# A checkpoint every 30 steps: longer than the persist takes at these sizes on that kind of
# machine (0.8-1.9 s), so the stall is the engine's own, not a wait for storage (at 10 steps
# every save waited for the host snapshot to drain). About 30 s per row on an H100; each row is
# also printed to bench.err as it ends, so a run cut off by the time limit keeps its rows.
want bench && { timeout "$BENCH_S" "$PY" examples/bench_scale.py --device cuda --batch 4096 --threads 8 \
    --sizes-gb 1.2 3 --interval "${GOCKPT_GPU_INTERVAL:-30}" --checkpoints 3 --modes lazy auto \
    >"$OUT/bench.txt" 2>"$OUT/bench.err"
echo "bench_scale: exit $?" | tee -a "$OUT/machine.txt"; }

# Steps shorter than the copy: K = 1 makes the update wait on the device for the copy (a wait
# the host does not see as stall); the planner should choose several windows here.
want small && { timeout "$SMALL_S" "$PY" examples/bench_scale.py --device cuda --batch 256 --threads 8 \
    --sizes-gb 1.2 --interval 200 --checkpoints 3 --modes lazy gockpt_o auto \
    >"$OUT/bench_small.txt" 2>"$OUT/bench_small.err"
echo "bench_scale, small batch: exit $?" | tee -a "$OUT/machine.txt"; }

# The replay's waits: gockpt_o held at K >= 7 over the same short steps. From the fourth window
# on a capture waits for a gradient buffer the CPU replay still holds; the engine table's
# "replay wait" column (predicted) is read beside the measured grad_buffer stall.
want replay && { timeout "$REPLAY_S" "$PY" examples/bench_scale.py --device cuda --batch 256 --threads 8 \
    --sizes-gb 1.2 --interval 200 --checkpoints 3 --modes gockpt_o --min-overlap-steps 7 --no-baselines \
    >"$OUT/bench_replay.txt" 2>"$OUT/bench_replay.err"
echo "bench_scale, small batch, K >= 7: exit $?" | tee -a "$OUT/machine.txt"; }

# Where a multi-step save's stall goes, save by save (the loop marks its step ends, as the
# adapters do); all three in probes.txt.
want probe && { for a in "gockpt_o 1 cuda 1.2 256" "gockpt_o 7 cuda 1.2 256" "auto 1 cuda 1.2 4096"; do
    echo "=== probe $a" >>"$OUT/probes.txt"
    PROBE_EVERY=$([[ $a == *4096 ]] && echo 30 || echo 200) timeout "$PROBE_S" \
        "$PY" scripts/gpu_probe_capture.py $a step_end >>"$OUT/probes.txt" 2>&1
    echo "probe ($a): exit $?" | tee -a "$OUT/machine.txt"
done; }

want tests && tail -n 40 "$OUT/tests.log"
for f in bench bench_small bench_replay; do [ -f "$OUT/$f.txt" ] && cat "$OUT/$f.txt"; done
want probe && grep -E "^(===|[a-z_]+ K>=| K=| save@| host alloc)" "$OUT/probes.txt" | cut -c1-400
cat "$OUT"/bench*.err 2>/dev/null | grep -c '^# done' | sed 's/^/bench rows finished: /'
