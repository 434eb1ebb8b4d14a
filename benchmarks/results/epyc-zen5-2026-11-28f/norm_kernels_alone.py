import time, torch
from layernorm.kernels.cpu import _native
def t(fn, n=2000):
    for _ in range(200): fn()
    best=[]
    for r in range(9):
        s=time.perf_counter()
        for _ in range(n): fn()
        best.append((time.perf_counter()-s)/n*1e6)
    return sorted(best)[len(best)//2]
for (m,n) in [(32,4096),(128,1024),(512,1024)]:
  for th in (1,2):
    torch.set_num_threads(th)
    x=torch.randn(m,n); w=torch.rand(n); b=torch.randn(n); dy=torch.randn(m,n)
    y,mu,rs=_native.ln_fwd(x,w,b,1e-5,for_backward=True)
    y2,mu2,rs2=torch.native_layer_norm(x,(n,),w,b,1e-5)
    r=dict(ours_f=t(lambda: _native.ln_fwd(x,w,b,1e-5,for_backward=True)), torch_f=t(lambda: torch.native_layer_norm(x,(n,),w,b,1e-5)),
      ours_b=t(lambda: _native.ln_bwd(dy,x,mu,rs,w,False,False,True,True,True)),
      torch_b=t(lambda: torch.ops.aten.native_layer_norm_backward(dy,x,(n,),mu2,rs2,w,b,[True,True,True])))
    print((m,n),th," ".join(f"{k}={v:.1f}" for k,v in r.items()))
