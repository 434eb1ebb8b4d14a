import torch, time, layernorm
torch.set_num_threads(1)
def t(fn, n=1000):
    for _ in range(100): fn()
    best=[]
    for r in range(7):
        s=time.perf_counter()
        for _ in range(n): fn()
        best.append((time.perf_counter()-s)/n*1e6)
    return sorted(best)[len(best)//2]
T,B,I,H=2,1,8,8
for kind in ("lstm","gru"):
    m = layernorm.LayerNormLSTM(I,H) if kind=="lstm" else layernorm.LayerNormGRU(I,H)
    tm = torch.nn.LSTM(I,H) if kind=="lstm" else torch.nn.GRU(I,H)
    x = torch.randn(T,B,I, requires_grad=True)
    for mod,name in ((m,"ours"),(tm,"torch")):
        def fb():
            mod(x)[0].sum().backward()
        def fwd():
            mod(x)
        def nog():
            with torch.no_grad(): mod(x)
        y = mod(x)[0].sum()
        def bwd():
            y.backward(retain_graph=True)
        print(kind, name, "fb %.1f fwd %.1f bwd %.1f nograd %.1f"%(t(fb), t(fwd), t(bwd), t(nog)))
