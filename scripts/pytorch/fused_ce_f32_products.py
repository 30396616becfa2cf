"""The f32 matrix products of two ways to cut the fused linear cross-entropy, timed on cuBLAS
through torch (TF32 off, as PyTorch's default and ours), to decide whether the f32 loss should
compute its gradients in the forward from blocks of whole rows (three products: logits,
dhidden, dweight accumulated block by block) instead of linear_cross_entropy's tiles (four: the
forward's logits, their recompute, dhidden, dweight).

- tile: tiles of all 8192 rows x 1920 classes (the default 64 MiB budget's f32 tiling), the
  forward's product, then the backward's three.
- rows: blocks of `rows` whole rows (as many as fit the budget: 64 at Llama-3.2-1B's 128,256
  classes, 320 at GPT-2's 50,257; 128 shown for comparison, over the budget at 1B).

Run on the GPU machine: python3 scripts/pytorch/fused_ce_f32_products.py
"""
import torch, json
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
def bench(fn, iters=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(iters): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters
out = {}
for name, T, H, V, rows_full, tile_rows, tile_cls in [("llama1b", 8192, 2048, 128256, 64, 8192, 1920), ("llama1b_r128", 8192, 2048, 128256, 128, 8192, 1920), ("gpt2", 8192, 768, 50257, 320, 8192, 1920)]:
    h = torch.randn(T, H, device=dev); W = torch.randn(V, H, device=dev) * 0.02
    dW = torch.zeros(V, H, device=dev); dh = torch.zeros(T, H, device=dev)
    # tile path: per tile of classes: logits (fwd), recompute, dh += dl @ W_t, dW_t = dl^T @ h
    def tile_path():
        for c in range(0, V, tile_cls):
            n = min(tile_cls, V - c)
            l = h @ W[c:c+n].T
    t_tile_one = bench(tile_path)
    def tile_bwd():
        for c in range(0, V, tile_cls):
            n = min(tile_cls, V - c)
            l = h @ W[c:c+n].T
            dh.addmm_(l, W[c:c+n])
            torch.mm(l.T, h, out=dW[c:c+n])
    t_tile_bwd = bench(tile_bwd, 3)
    R = rows_full
    def rows_path():
        for r in range(0, T, R):
            l = h[r:r+R] @ W.T
            torch.mm(l, W, out=dh[r:r+R])
            dW.addmm_(l.T, h[r:r+R])
    t_rows = bench(rows_path, 3)
    out[name] = dict(tile_forward_ms=t_tile_one, tile_backward_ms=t_tile_bwd, tile_total_ms=t_tile_one + t_tile_bwd, rows_total_ms=t_rows, rows=R)
    print(name, out[name], flush=True)
    del h, W, dW, dh
    torch.cuda.empty_cache()
