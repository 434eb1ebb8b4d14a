#!/usr/bin/env bash
# Every CPU benchmark of benchmarks/RESULTS.md in one go (`make bench`): for each instruction-set
# target this processor can run (AVX-512 with and without the bfloat16 instructions, AVX2
# emulated on an AVX-512 processor by the compiler's target flags, portable) and with 1 and 2
# threads:
#   - every norm variant, forward + backward and forward alone, float32 and bfloat16, against
#     torch's layer_norm, and the modules on small (per-token) inputs against torch.nn.LayerNorm /
#     RMSNorm;
#   - LN-LSTM and LN-GRU against torch.nn.LSTM / GRU, training and inference, at the six shapes
#     of the targets; with one thread also the peak memory of a call;
#   - the same layers in inference one step at a time (T = 1: a decoder's token, each call given
#     a state), where a call costs its Python and its weights' reads more than its arithmetic;
#   - LN-LSTM and LN-GRU in bfloat16 against torch's bfloat16 layers at three shapes, with the
#     rounded recurrent products beside the default (where the target has them);
# and once, on the processor's own target: the layers with torch.nn's options (several layers,
# both directions, batch_first, packed sequences, proj_size) at other sizes, the cells against
# torch.nn's cells one step per call (bench_cells.py), and what an LN-LSTM training call costs
# besides its kernels (rnn_call_overhead.py).
# Where AVX2 is emulated (the processor has AVX-512), its recurrent and norm tables run twice:
# against torch's kernels at the processor's width, and with torch's restricted to AVX2 too
# (ATen, MKL, oneDNN: _timing.TORCH_ISA_ENV), which is how both sides run on an AVX2 processor.
# Each table starts with its processor, kernel target, torch version and ISA, and threads.
# Ratios are ours / torch in the same process; run it on a machine with nothing else running.
#   ISAS="avx2" THREADS="1" benchmarks/run_all.sh     # a subset
#   REPS=15 benchmarks/run_all.sh                      # more rounds per provider
#   CLOCK=thread benchmarks/run_all.sh                 # one-thread recurrent tables in the
#                                                      # thread's CPU time (a shared machine)
#   NORM_ARGS="--shapes 64x768 --small-reps 100" SHAPES=50x8x64x128 REPS=1 \
#     OPTIONS_ONLY="lstm 50x8x64x128 {}" CELL_ARGS="--shapes 1x64x128" \
#     benchmarks/run_all.sh                                   # a quick check that every table runs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
ISAS=${ISAS:-$("$PY" -c 'from layernorm.kernels.cpu import targets; print(*targets.available())')}
THREADS=${THREADS:-"1 2"}
REPS=${REPS:-7}
SHAPES=${SHAPES:-100x32x128x256,100x64x256x512,50x8x64x128,200x16x64x256,1000x4x32x128,35x20x650x650}
STEP_SHAPES=${STEP_SHAPES:-1x1x256x256,1x8x256x256,1x32x256x256,1x32x512x512,1x16x1024x1024,1x1x1024x1024}
STEP_REPS=${STEP_REPS:-200}
HALF_SHAPES=${HALF_SHAPES:-100x32x128x256,50x8x64x128,1000x4x32x128}
echo "processor: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) |" \
     "features: $(grep -o -w 'avx2\|avx512f\|avx512_bf16\|f16c' /proc/cpuinfo | sort -u | xargs) |" \
     "targets: $ISAS | $("$PY" -c 'import torch, sys; print("torch", torch.__version__, "| python", sys.version.split()[0])')"
AVX512=$(grep -q -w avx512f /proc/cpuinfo && echo 1 || echo 0)
tables() {  # every table of one target ($1) and thread count ($2)
    local isa=$1 t=$2 dtype mode opts=""
    for dtype in float32 bfloat16; do
        # shellcheck disable=SC2086
        "$PY" benchmarks/bench_norms_cpu.py --isa "$isa" --threads "$t" --dtype "$dtype" \
            ${NORM_ARGS:-}
        # the forward alone (inference), without the modules' table again
        # shellcheck disable=SC2086
        "$PY" benchmarks/bench_norms_cpu.py --isa "$isa" --threads "$t" --dtype "$dtype" \
            ${NORM_ARGS:-} --forward --small-shapes
    done
    [ "$t" = 1 ] && opts="--memory --clock ${CLOCK:-wall}"
    for mode in train infer; do
        # shellcheck disable=SC2086
        "$PY" benchmarks/bench_rnn.py --isa "$isa" --threads "$t" --mode "$mode" \
            --reps "$REPS" --shapes "$SHAPES" $opts
    done
    "$PY" benchmarks/bench_rnn.py --isa "$isa" --threads "$t" --mode infer \
        --reps "$STEP_REPS" --shapes "$STEP_SHAPES" --state
    for mode in train infer; do
        "$PY" benchmarks/bench_rnn.py --isa "$isa" --threads "$t" --mode "$mode" \
            --dtype bfloat16 --kinds lstm,gru --reps "$REPS" --shapes "$HALF_SHAPES"
    done
}
for isa in $ISAS; do
    for t in $THREADS; do
        echo; echo "## target $isa, $t thread(s)"
        tables "$isa" "$t"
        if [ "$isa" = avx2 ] && [ "$AVX512" = 1 ]; then
            echo; echo "## target avx2, $t thread(s), torch's kernels restricted to AVX2 as well"
            ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
                tables "$isa" "$t"
        fi
    done
done
for t in $THREADS; do
    echo; echo "## the layers with torch.nn's options, $t thread(s)"
    "$PY" benchmarks/bench_rnn_options.py --threads "$t" --reps "$REPS" --only "${OPTIONS_ONLY:-}"
done
# the cells' large steps with glibc's mmap and trim thresholds fixed (bench_cells.py: a weight
# gradient's MiBs come back from the heap or as fresh pages by the process's history, 2x apart)
for t in $THREADS; do
    echo; echo "## the cells, one step per call, $t thread(s), malloc's thresholds fixed"
    # shellcheck disable=SC2086
    MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=1073741824 \
        "$PY" benchmarks/bench_cells.py --threads "$t" --reps "$REPS" ${CELL_ARGS:-}
done
echo; echo "## an LN-LSTM training call besides its kernels (planned, fused, a node doing nothing)"
"$PY" benchmarks/rnn_call_overhead.py --threads 1
