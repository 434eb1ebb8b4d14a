import torch, time, layernorm, collections
from layernorm.kernels.cpu import rnn_abi
torch.set_num_threads(1)
orig = rnn_abi.pack
rec = collections.defaultdict(list)
def timed(struct, dtype, values, sizes):
    s=time.perf_counter_ns(); r=orig(struct, dtype, values, sizes); rec[struct.name, len(values)].append(time.perf_counter_ns()-s); return r
rnn_abi.pack = timed
import layernorm.kernels.cpu.rnn as rnn
for kind in ("lstm","gru"):
    rec.clear()
    m = layernorm.LayerNormLSTM(64,128) if kind=="lstm" else layernorm.LayerNormGRU(64,128)
    x = torch.randn(50,8,64, requires_grad=True)
    for _ in range(300): m(x)[0].sum().backward()
    for k,v in rec.items():
        v=sorted(v); print(kind, k, len(v)//300, "per call, median us %.1f"%(v[len(v)//2]/1e3))
    rec.clear()
    with torch.no_grad():
        for _ in range(300): m(x)
    for k,v in rec.items():
        v=sorted(v); print(kind, "infer", k, len(v)/300, "per call, median us %.1f"%(v[len(v)//2]/1e3))
