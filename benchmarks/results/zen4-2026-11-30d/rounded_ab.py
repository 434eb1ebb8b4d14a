"""The driver of ``rounded_gradient_products_train.txt``: bfloat16 training calls (forward and
``backward()`` of the output's float sum) of ``torch.nn.LSTM`` / ``GRU``, ours inside
``bfloat16_recurrent_products()`` and ours by default, in turn (``_timing.interleaved_samples``);
the medians' ratios to torch's. Run with a tree's ``src`` on ``PYTHONPATH`` to time that tree:

    OMP_NUM_THREADS=1 PYTHONPATH=<tree>/src python rounded_ab.py 1 100x32x128x256 lstm,gru 5
"""

import statistics
import sys
from pathlib import Path

import torch

import layernorm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _timing import interleaved_samples

torch.set_num_threads(int(sys.argv[1]))
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["lstm", "gru"]
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 7
for kind in kinds:
    for T, B, I, H in shapes:
        torch.manual_seed(0)
        theirs = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](I, H).bfloat16()
        ours = {"lstm": layernorm.LayerNormLSTM, "gru": layernorm.LayerNormGRU}[kind](I, H)
        ours = ours.bfloat16()
        x = torch.randn(T, B, I).bfloat16().requires_grad_()

        def call(m, rounded, x=x):
            def run():
                if rounded:
                    with layernorm.recurrent.bfloat16_recurrent_products():
                        out, _ = m(x)
                else:
                    out, _ = m(x)
                out.float().sum().backward()
                for p in m.parameters():
                    p.grad = None
                x.grad = None

            return run

        providers = {"torch": call(theirs, False), "rounded": call(ours, True),
                     "default": call(ours, False)}  # fmt: skip
        samples = interleaved_samples(providers, warmup=2, reps=reps)
        med = {k: statistics.median(v) for k, v in samples.items()}
        print(f"{kind} {(T, B, I, H)} torch {med['torch']:.1f} ms  "
              f"rounded/torch {med['rounded'] / med['torch']:.2f}  "
              f"default/torch {med['default'] / med['torch']:.2f}", flush=True)  # fmt: skip
