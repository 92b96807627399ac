"""The fused bf16 AdamW kernel of --optimizer_dtype bf16 on CUDA, or in Triton's CPU
interpreter (run with TRITON_INTERPRET=1); tests/test_optim.py starts it and asserts on the
JSON line it prints: against the torch update rounded to nearest and stochastically, small
updates, fresh noise."""
import json

import torch

from dschat.engine import low_precision_adam as lpa

N = 5000          # not a multiple of the kernel's block
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(fused: bool, stochastic: bool, steps: int, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    opt = lpa.StochasticRoundingAdamW([w], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stochastic=stochastic,
                                      generator=torch.Generator().manual_seed(seed), fused=None if fused else False)
    # a state some steps in (moments of a gradient's scale), the same for both updates
    opt.state[w] = {"step": torch.tensor(5.0),
                    "exp_avg": (0.3 * torch.randn(N, generator=g)).to(DEVICE, torch.bfloat16),
                    "exp_avg_sq": (0.5 * torch.rand(N, generator=g)).to(DEVICE, torch.bfloat16)}
    used = []
    for _ in range(steps):
        w.grad = torch.randn(N, generator=g).to(DEVICE, torch.bfloat16)
        used.append(opt.fused is not False and lpa.fused_available(w, w.grad, w, w))
        opt.step()
    state = opt.state[w]
    return tuple(t.detach().float().cpu() for t in (w, state["exp_avg"], state["exp_avg_sq"])), all(used)


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between a and b in bf16 spacings of the larger magnitude (an
    absolute floor of 1e-4 of b's rms keeps values that cancel to near zero out of it)."""
    spacing = 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-4 * b.pow(2).mean().sqrt()
    return float(((a - b).abs() / spacing).max())


names = ("weight", "exp_avg", "exp_avg_sq")
out = {"nearest_differ_share": {}, "nearest_max_steps": {}, "stochastic_differ_share": {}, "stochastic_max_steps": {}}
fused, out["fused_used"] = run(True, False, 1)
plain, out["torch_used_fused"] = run(False, False, 1)
for name, a, b in zip(names, fused, plain):
    out["nearest_differ_share"][name] = float((a != b).float().mean())
    out["nearest_max_steps"][name] = bf16_steps(a, b)
sr, _ = run(True, True, 1)
nearest, _ = run(False, False, 1)
for name, a, b in zip(names, sr, nearest):
    out["stochastic_differ_share"][name] = float((a != b).float().mean())
    out["stochastic_max_steps"][name] = bf16_steps(a, b)
other_seed, _ = run(True, True, 1, seed=2)
out["fresh_noise_differ_share"] = float((other_seed[0] != sr[0]).float().mean())

# launches of FUSED_LAUNCH elements: the same numbers rounded to nearest, fresh noise per launch
launch = lpa.FUSED_LAUNCH
lpa.FUSED_LAUNCH = 1024
split_nearest, _ = run(True, False, 1)
out["split_launch_nearest_equal"] = all(bool(torch.equal(a, b)) for a, b in zip(split_nearest, fused))
w = torch.zeros(4096, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)   # every element alike
opt = lpa.StochasticRoundingAdamW([w], lr=1e-3, weight_decay=0.0, generator=torch.Generator().manual_seed(0))
w.grad = torch.full_like(w, 0.37)
opt.step()
m = opt.state[w]["exp_avg"].float().cpu().view(4, 1024)      # 0.037 rounded up or down per element
out["split_launch_noise_repeats"] = any(bool(torch.equal(m[0], m[k])) for k in (1, 2, 3))
out["split_launch_rounded_both_ways"] = len(m.unique()) == 2
lpa.FUSED_LAUNCH = launch

# small updates: a constant gradient at lr 1e-4 moves a weight of 1.0 by lr a step in the mean
lr, steps, n = 1e-4, 100, 8192
out["lr"], out["steps"], out["small_update_mean"] = lr, steps, {}
for stochastic in (True, False):
    w = torch.ones(n, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    opt = lpa.StochasticRoundingAdamW([w], lr=lr, weight_decay=0.0, stochastic=stochastic,
                                      generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        w.grad = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
        opt.step()
    out["small_update_mean"]["stochastic" if stochastic else "nearest"] = w.detach().double().mean().item()
out["device"] = DEVICE
print(json.dumps(out))
