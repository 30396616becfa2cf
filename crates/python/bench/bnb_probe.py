"""bitsandbytes' Adam8bit against headroom's, one step from p = 0 on 1,000-element (32-bit path)
and 8,192-element (8-bit path) tensors, for gradients of one magnitude each: the update over
lr·sign(g), and whether the two agree bit for bit. Then ViT-L's head alone, and ViT-L's first
block's parameters."""
import copy, json, torch, torchvision
import bitsandbytes as bnb
import headroom.optim
dev = torch.device("cuda")
torch.manual_seed(0)

def one(make, p0, g, steps=1):
    p = torch.nn.Parameter(p0.clone()); p.grad = g.clone()
    opt = make([p])
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    return p.detach()

for n in (1000, 8192):
    for mag in (1e-7, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0):
        for p_kind in ("zero", "rand"):
            p0 = torch.zeros(n, device=dev) if p_kind == "zero" else torch.randn(n, device=dev) * 0.02
            g = torch.randn(n, device=dev).sign() * mag
            b = one(lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3), p0, g)
            h = one(lambda ps: headroom.optim.Adam8bit(ps, lr=1e-3), p0, g)
            ratio = lambda x: float(((x - p0).double() / (-1e-3 * g.double().sign())).median())
            print(json.dumps({"n": n, "g": mag, "p0": p_kind, "bnb": ratio(b), "ours": ratio(h),
                              "bitwise": bool(torch.equal(b, h)), "differ": int((b != h).sum())}), flush=True)

with dev:
    vit = torchvision.models.vit_l_16(weights=None)
x = torch.randn(1, 3, 224, 224, device=dev)
torch.nn.functional.cross_entropy(vit(x), torch.tensor([3], device=dev)).backward()
named = [(n, p) for n, p in vit.named_parameters()]
for name in ("heads.head.weight", "heads.head.bias", "encoder.layers.encoder_layer_0.ln_1.bias",
             "encoder.layers.encoder_layer_0.mlp.0.weight", "encoder.ln.bias", "conv_proj.weight"):
    p = dict(named)[name]
    g = p.grad.detach()
    for steps in (1, 2):
        b = one(lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3), p.detach(), g, steps)
        h = one(lambda ps: headroom.optim.Adam8bit(ps, lr=1e-3), p.detach(), g, steps)
        print(json.dumps({"name": name, "steps": steps, "numel": p.numel(), "bitwise": bool(torch.equal(b, h)),
                          "differ": int((b != h).sum()), "g_absmax": float(g.abs().max()),
                          "g_absmedian": float(g.abs().median()), "p_absmax": float(p.abs().max())}), flush=True)
