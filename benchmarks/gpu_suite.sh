#!/usr/bin/env bash
# Everything the Triton backend needs checked and measured on a CUDA machine, in stages that each
# fit in a few minutes:
#
#   bash benchmarks/gpu_suite.sh tests  [OUTDIR]   # the Triton tests, compiled, gpu-marked included
#   bash benchmarks/gpu_suite.sh sweep  [OUTDIR]   # bench_norms_gpu.py: GB/s sweep, latency, LN-LSTM
#   bash benchmarks/gpu_suite.sh tune   [OUTDIR]   # bench_norms_gpu.py --tune: launch settings
#   bash benchmarks/gpu_suite.sh host   [OUTDIR]   # the CPU kernels on this machine's processor
#   bash benchmarks/gpu_suite.sh all    [OUTDIR]   # tests, sweep, tune (not host)
#
# OUTDIR (default benchmarks/results) receives the logs, the CSV and the plot. Liger-Kernel is
# compared when it imports; wheels placed in .whl/ are installed first (the machine may be
# offline). The package is used from src/ so that no install step is needed. Extra arguments per
# stage: TEST_ARGS (pytest, e.g. "-n 8 -x"), SWEEP_ARGS and TUNE_ARGS (bench_norms_gpu.py, e.g.
# "--ns 1024 4096 65536" or "--tune-factors elems_per_thread"), HOST_WORKERS, HOST_SHAPES and
# HOST_ISAS (e.g. "avx512": one target's tables only).
#
# The host stage checks the C kernels on the GPU machine's own processor, often one with AVX-512
# where the project's other machines may have AVX2 only: first, on the quiet machine, LN-LSTM/GRU
# against torch per target (1 and 2 threads, training and inference, the six shapes of the
# targets), the recurrent GEMM's tile against MKL, and the layers' inference with the tile
# against MKL's packed GEMM per target (ab_rnn.py --gemm) and the tile with A copied per row tile
# (GEMM_PACK_A, bench_rnn_gemm.py and ab_rnn.py --cflags); then the tests of every instruction-set
# target (after the timings: a test run cut by a time limit can leave its workers running, and
# timings beside running tests are not results). It needs a C compiler there (and uses
# pytest-xdist where it is installed).
#
# Wall times seen on an H200 machine (16 cores, 2026-11-26), for planning a short lease: tests
# with TEST_ARGS="-n 8" 45 s; sweep with SWEEP_ARGS="--ns 1024 4096 16384 65536 262144" (five N,
# torch.compile recompiling per shape) 95 s; tune 95 s (84 s of timings); host: about 30 s per
# recurrent table at the six shapes, 20 s for the GEMM (before the packed-A builds were added
# beside it), then about 140 s of tests at 12 workers.
# The machine's start adds about a minute (30 s on 2026-11-27; tests with -n 8 then took 69 s).
# On 2026-11-30 the tests took 214 s with -n 14 (over 150 s with -n 8): the recurrent-layer tests
# wait about two minutes for the C kernels and C++ operators to build on the fresh host. The
# stage already passes -q; a second one in TEST_ARGS hides pytest's summary line.
set -euo pipefail

stage="${1:-all}"
out="${2:-benchmarks/results}"
case "$stage" in
    tests | sweep | tune | host | all) ;;
    *) echo "gpu_suite.sh: stage must be tests, sweep, tune, host or all, got '$stage'" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"

if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/layernorm-site \
        .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/layernorm-site"
fi

"$py" - <<'EOF'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
if [[ "$stage" != host ]]; then
    "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_suite.sh: no CUDA device")'
fi

run_tests() {
    # Compiled kernels (no TRITON_INTERPRET): the same correctness tests plus the gpu-marked ones.
    "$py" -m pytest -q -p no:cacheprovider tests/test_triton_norms.py tests/test_triton_rnn_step.py \
        tests/test_triton_compile.py tests/test_recurrent_layers.py ${TEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log"
}

run_sweep() {
    "$py" benchmarks/bench_norms_gpu.py --csv "$out/bench_norms_gpu.csv" \
        --plot "$out/norms_gpu.png" ${SWEEP_ARGS:-} 2>&1 | tee "$out/gpu_sweep.log"
}

run_tune() {
    "$py" benchmarks/bench_norms_gpu.py --tune --csv "$out/bench_norms_gpu.csv" ${TUNE_ARGS:-} 2>&1 \
        | tee "$out/gpu_tune.log"
}

run_host() {
    { grep -m1 'model name' /proc/cpuinfo; uptime; } | tee "$out/host_bench.log"
    local isas shapes
    isas=$("$py" -c 'from layernorm.kernels.cpu import targets; print(*targets.available())')
    shapes=${HOST_SHAPES:-100x32x128x256,100x64x256x512,50x8x64x128,200x16x64x256,1000x4x32x128,35x20x650x650}
    for isa in ${HOST_ISAS:-$isas}; do
        [[ "$isa" == portable ]] && continue
        for threads in 1 2; do
            for mode in train infer; do
                "$py" benchmarks/bench_rnn.py --isa "$isa" --threads "$threads" --mode "$mode" \
                    --reps 5 --shapes "$shapes" 2>&1 | tee -a "$out/host_bench.log"
            done
        done
    done
    # bfloat16 layers against torch's (oneDNN's bfloat16 GEMMs, AMX where the host has it), the
    # rounded recurrent products beside the default; one thread, the processor's own target
    for mode in train infer; do
        "$py" benchmarks/bench_rnn.py --threads 1 --mode "$mode" --dtype bfloat16 \
            --kinds lstm,gru --reps 5 --shapes "$shapes" 2>&1 | tee -a "$out/host_bench.log"
    done
    # beside each target's default build, its build with A copied per row tile (GEMM_PACK_A in
    # rnn_seq_impl.h: off by default, level on the AMD EPYC; for processors with two 512-bit FMA
    # units, where the default tile's reloads of row pointers are a larger share of the loop)
    "$py" benchmarks/bench_rnn_gemm.py --reps 5 --inner 5 --rows 4,8,16,32,64 \
        --hidden 128,256,512,650 --variant packa=-DGEMM_PACK_A=1 2>&1 | tee "$out/host_gemm.log"
    "$py" benchmarks/ab_rnn.py --cflags --a="" --b="-DGEMM_PACK_A=1" --mode infer --reps 7 \
        --shape "$shapes" 2>&1 | tee -a "$out/host_gemm.log"
    # the sequence kernels' recurrent GEMM: the tile against MKL's packed GEMM, per target
    for isa in ${HOST_ISAS:-$isas}; do
        [[ "$isa" == portable ]] && continue
        LAYERNORM_CPU_ISA=$isa "$py" benchmarks/ab_rnn.py --gemm --a tile --b mkl --mode infer \
            --reps 7 --shape "$shapes" 2>&1 | tee -a "$out/host_gemm.log"
    done
    local workers=()
    "$py" -c 'import xdist' 2>/dev/null && workers=(-n "${HOST_WORKERS:-8}")
    "$py" -m pytest -q -p no:cacheprovider "${workers[@]}" tests/test_cpu_isa.py \
        tests/test_torch_ops.py tests/test_cxx_build.py tests/test_cpu_fast_paths.py \
        tests/test_half_kernels.py tests/test_recurrent_cseq.py \
        tests/test_recurrent_inference.py tests/test_rnn_kernel_abi.py \
        tests/test_kernel_accuracy.py 2>&1 | tee "$out/host_tests.log"
}

case "$stage" in
    tests) run_tests ;;
    sweep) run_sweep ;;
    tune) run_tune ;;
    host) run_host ;;
    all) run_tests; run_sweep; run_tune ;;
esac
