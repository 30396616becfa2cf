"""Does a linear's weight-gradient GEMM run beside its input-gradient GEMM (two streams) save time
at ViT-L/16 batch 1 (197 rows)? f32, TF32 off, cuBLAS through torch.mm. For each of ViT-L/16's
four linear shapes, one JSON line: microseconds of the forward, input-gradient and
weight-gradient products alone, the pair in sequence and the pair on two streams (200 runs each
after 10 warm-ups). The measurement behind not overlapping them in Headroom's backward (issue
36: at most 4% of the pair).

Usage: python3 scripts/pytorch/gemm_overlap.py
"""
import argparse
import json

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()

import torch  # noqa: E402 (after --help, which needs no torch)
torch.backends.cuda.matmul.allow_tf32 = False
dev = 'cuda'
M = 197
shapes = [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]  # (in, out)
side = torch.cuda.Stream()
def bench(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3  # us
for fin, fout in shapes:
    x = torch.randn(M, fin, device=dev); w = torch.randn(fout, fin, device=dev); dy = torch.randn(M, fout, device=dev)
    dx = torch.empty(M, fin, device=dev); dw = torch.empty(fout, fin, device=dev); y = torch.empty(M, fout, device=dev)
    fwd = lambda: torch.mm(x, w.t(), out=y)
    dgrad = lambda: torch.mm(dy, w, out=dx)
    wgrad = lambda: torch.mm(dy.t(), x, out=dw)
    def seq():
        wgrad(); dgrad()
    def par():
        ev = torch.cuda.Event(); ev.record()
        side.wait_event(ev)
        with torch.cuda.stream(side):
            wgrad()
        dgrad()
        ev2 = torch.cuda.Event(); ev2.record(side)
        torch.cuda.current_stream().wait_event(ev2)
    r = dict(shape=[M, fin, fout], fwd_us=bench(fwd), dgrad_us=bench(dgrad), wgrad_us=bench(wgrad), seq_us=bench(seq), par_us=bench(par))
    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}))
