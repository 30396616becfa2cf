"""Bad input gives clear Python exceptions (GPU machine, torch installed): CPU, float16 and
non-contiguous parameters, a step off the default stream, a state dict of another model with the
same parameter count, a model cast to float16 after the optimizer was made, and use_allocator
after CUDA memory was allocated. Prints one line per check and exits non-zero if any fails.
(tests/test_optim_misuse.py holds every misuse case; these are the ones a user meets first.)"""

import sys

import torch

import headroom.cuda
import headroom.optim

failures = 0


def expect(exc, fn, label):
    global failures
    try:
        fn()
    except exc as error:
        print(f"ok   {label}: {type(error).__name__}: {error}")
        return
    except Exception as error:  # noqa: BLE001
        print(f"FAIL {label}: {type(error).__name__}: {error}")
    else:
        print(f"FAIL {label}: no exception")
    failures += 1


expect(TypeError, lambda: headroom.optim.AdamW([torch.zeros(4)]), "CPU parameter")
expect(TypeError, lambda: headroom.optim.Adam8bit([torch.zeros(4, device="cuda", dtype=torch.float16)]), "float16 parameter")
expect(ValueError, lambda: headroom.optim.Adam([torch.zeros(4, 4, device="cuda").t()]), "non-contiguous parameter")
p = torch.zeros(8192, device="cuda", requires_grad=True)
p.grad = torch.ones_like(p)
opt = headroom.optim.AdamW([p])
s = torch.cuda.Stream()


def side_stream_step():
    with torch.cuda.stream(s):
        opt.step()


expect(ValueError, side_stream_step, "step on a side stream")
opt.step()
torch.cuda.synchronize()
print(f"ok   one AdamW step moved the parameter to {float(p.detach()[0]):.6f}")

# A state dict of another model: 8x4 + 8 elements against 4x8 + 8, the same count.
donor_model = torch.nn.Linear(8, 4).cuda()
donor = headroom.optim.AdamW(donor_model.parameters())
donor_model(torch.ones(2, 8, device="cuda")).sum().backward()
donor.step()
model = torch.nn.Linear(4, 8).cuda()
other = headroom.optim.AdamW(model.parameters())
other.load_state_dict(donor.state_dict())
model(torch.ones(2, 4, device="cuda")).sum().backward()
expect(ValueError, other.step, "state dict of another model, same parameter count")
model.half()
expect(TypeError, other.step, "model.half() after the optimizer was made")
expect(headroom.cuda.AllocatorError, headroom.cuda.use_allocator, "use_allocator after CUDA allocated")
sys.exit(1 if failures else 0)
