#!/bin/bash
# as ab_cells.sh, on the AVX2 build with torch held to AVX2
cd /work/main
export LAYERNORM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
for r in 1 2; do
 for tree in base new; do
  if [ $tree = base ]; then P=/tmp/base/src; else P=/work/main/src; fi
  PYTHONPATH=$P .venv/bin/python benchmarks/bench_cells.py --threads ${1:-1} --kinds ${2:-lstm,gru,rnn} --shapes ${3:-1x64x128,8x64x128,32x128x256} --modes ${4:-train} 2>&1 | grep -E '^device|^\| (lstm|gru|rnn)' | sed "s/^/$tree r$r /"
 done
done
