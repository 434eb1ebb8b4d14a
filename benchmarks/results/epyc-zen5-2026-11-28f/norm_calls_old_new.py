import time, torch, sys
import torch.nn.functional as F
import layernorm, layernorm.functional as LF
torch.set_num_threads(int(sys.argv[1]))
def t(fn, n=2000):
    for _ in range(200): fn()
    best=[]
    for r in range(7):
        s=time.perf_counter()
        for _ in range(n): fn()
        best.append((time.perf_counter()-s)/n*1e6)
    return sorted(best)[len(best)//2]
out=[]
for dt in (torch.float32, torch.bfloat16):
  for (m,n) in [(1,1024),(8,768),(100,100),(128,1024)]:
    x=(torch.randn(m,n)+0.5).to(dt).requires_grad_(); w=(torch.rand(n)+.5).to(dt).requires_grad_(); b=torch.randn(n).to(dt).requires_grad_(); dy=torch.randn(m,n).to(dt)
    def fb(op):
        def run():
            x.grad=w.grad=b.grad=None
            op().backward(dy)
        return run
    xd=x.detach()
    def nog(f):
        def run():
            with torch.no_grad(): f()
        return run
    r = dict(torch=t(fb(lambda: F.layer_norm(x,(n,),w,b))), layer_norm=t(fb(lambda: LF.layer_norm(x,(n,),w,b))),
      rms_norm=t(fb(lambda: LF.rms_norm(x,(n,),w))), ada_norm=t(fb(lambda: LF.ada_norm(x,(n,)))),
      layer_norm_nograd=t(nog(lambda: LF.layer_norm(xd,(n,),w,b))), rms_norm_nograd=t(nog(lambda: LF.rms_norm(xd,(n,),w))))
    print(str(dt)[6:], f"{m}x{n}", " ".join(f"{k}={v:.1f}" for k,v in r.items()))
