#!/bin/bash
# alternate base/new processes of bench_cells; args: threads kinds shapes modes
cd /work/main
for r in 1 2; do
 for tree in base new; do
  if [ $tree = base ]; then P=/tmp/base/src; else P=/work/main/src; fi
  PYTHONPATH=$P .venv/bin/python benchmarks/bench_cells.py --threads ${1:-1} --kinds ${2:-lstm,gru} --shapes ${3:-1x64x128,8x64x128,1x256x256,32x128x256} --modes ${4:-train} 2>&1 | grep -E '^\| (lstm|gru|rnn)' | sed "s/^/$tree r$r /"
 done
done
