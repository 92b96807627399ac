"""AdamW for bf16 master weights: weights and moments in bf16, written with stochastic
rounding (`--optimizer_dtype bf16`).

Mixed-precision Adam keeps 16 bytes per trained parameter (bf16 weights and gradients, fp32
master weights and two fp32 moments). With DeepSpeed's `bf16_master_weights_and_grads` and
`bf16_optimizer_states` the bf16 weight partitions are the master weights themselves and the
moments are bf16: 8 bytes per parameter. What is lost is the small update: at PPO's learning
rates an Adam step changes a weight by about lr (1e-6..1e-5), far below half of bf16's spacing
(2^-8 of the weight's magnitude), so round-to-nearest writes the old weight back and the model
does not learn. Stochastic rounding rounds up with probability equal to the distance to the
lower neighbour, so every write is unbiased and the small updates add up in expectation
(benchmarks/optimizer_dtype.py measures this on a real model). The moments are written the
same way: Adam's second moment moves by (1 - beta2) of itself a step (0.1% at beta2 0.999),
below bf16's relative spacing (0.4-0.8%), so round-to-nearest stalls it away from its average.

On CUDA the whole update of a bf16 tensor is one Triton kernel (`fused_sr_adamw_`): each
element's weight, gradient and moments are read once and written once (14 bytes an element),
the maths in fp32 registers, the rounding noise from Philox. Elsewhere (the CPU, fp32
parameters, no Triton) the update runs as torch operations in fp32 on chunks of each tensor
(a bounded temporary), with the same rounding points.
"""
from __future__ import annotations

import math
import os

import torch

try:                                   # pragma: no cover - exercised on GPU machines and in the interpreter
    import triton
    import triton.language as tl
except Exception:                      # no Triton: the torch update serves
    triton = None

CHUNK = 1 << 24   # elements per fp32 temporary: 64 MiB a buffer
FUSED_BLOCK = 1024
FUSED_LAUNCH = 1 << 30   # elements per kernel launch: Philox's per-element counter is 32-bit


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Write fp32 `src` into bf16 `dst`, rounding each value to one of its two bf16 neighbours
    with probabilities that make the result unbiased. `src` is overwritten (used as scratch).

    A bf16 value is the upper 16 bits of the fp32 one: adding a uniform 16-bit integer to the
    fp32 bit pattern carries into the upper half with probability (lower bits) / 2^16, and
    clearing the lower half then truncates. Signs need no care: the pattern is sign-magnitude,
    so the carry rounds the magnitude up and the truncation rounds it toward zero.
    """
    bits = src.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    bits.add_(noise).bitwise_and_(-65536)   # -65536 == 0xFFFF0000 as int32
    dst.copy_(src)                          # exact: the lower 16 bits are zero


if triton is not None:
    @triton.jit
    def _round_bits(x, noise, STOCHASTIC: tl.constexpr):
        """fp32 `x` on bf16's grid (lower 16 bits cleared, so the cast to bf16 is exact): after
        adding `noise` (uniform in [0, 2^16): stochastic rounding), or to nearest, ties to even
        (in bits: Triton's CPU interpreter truncates in its fp32 -> bf16 cast)."""
        bits = x.to(tl.int32, bitcast=True)
        if STOCHASTIC:
            bits = bits + noise
        else:
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _sr_adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, seed, beta1, beta2, eps, decay, step_size,
                         bias2_sqrt, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(p_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        m = m * beta1 + g * (1.0 - beta1)
        v = v * beta2 + g * g * (1.0 - beta2)
        w = w * decay - step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
        # three 16-bit draws per element from one Philox call (offsets are unique per element)
        r0, r1, r2, _ = tl.randint4x(seed, offs.to(tl.int32))
        w = _round_bits(w, (r0 & 0xFFFF).to(tl.int32), STOCHASTIC)
        m = _round_bits(m, (r1 & 0xFFFF).to(tl.int32), STOCHASTIC)
        v = _round_bits(v, (r2 & 0xFFFF).to(tl.int32), STOCHASTIC)
        tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty), mask=inside)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=inside)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=inside)


def fused_available(p: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether `fused_sr_adamw_` takes this parameter: Triton present, a bf16 parameter and
    moments, every tensor contiguous, on CUDA (or Triton's interpreter: CPU tensors)."""
    on_device = p.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and on_device and p.dtype == torch.bfloat16
            and all(t.dtype == torch.bfloat16 for t in tensors[1:]) and p.is_contiguous()
            and all(t.is_contiguous() and t.device == p.device for t in tensors))


def fused_sr_adamw_(p, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, seed,
                    stochastic: bool = True) -> None:
    """One AdamW step of bf16 `p` and its bf16 moments in place, one Triton kernel per
    FUSED_LAUNCH elements (see `fused_available`); `seed` picks this call's rounding noise,
    each launch drawing from its own Philox stream (a ZeRO-1/2 partition at 7B is one flat
    tensor of more than 2^31 elements)."""
    flat = [t.view(-1) for t in (p, grad, exp_avg, exp_avg_sq)]
    for i, start in enumerate(range(0, p.numel(), FUSED_LAUNCH)):
        part = [t[start:start + FUSED_LAUNCH] for t in flat]
        n = part[0].numel()
        _sr_adamw_kernel[(triton.cdiv(n, FUSED_BLOCK),)](
            *part, n, (seed + 1_000_003 * i) % (2 ** 31 - 1), beta1, beta2, eps, 1.0 - lr * weight_decay,
            lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), STOCHASTIC=stochastic, BLOCK=FUSED_BLOCK)


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction, as torch.optim.AdamW) whose moments
    live in the parameter's dtype; bf16 weights and moments are written with stochastic
    rounding. fp32 parameters are updated exactly as torch's AdamW would."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, generator: torch.Generator | None = None, stochastic: bool = True,
                 fused: bool | None = None):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        # amsgrad/maximize are read by DeepSpeed's partial-offload path; they are always off here
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=False, maximize=False))
        self.generator = generator
        self.stochastic = stochastic    # False: round to nearest (benchmarks/optimizer_dtype.py's contrast)
        # None: the Triton kernel wherever `fused_available`; False: always the torch update
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StochasticRoundingAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                self._update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1,
                             beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step)
        return loss

    def _update(self, p, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step):
        if self.fused is not False and fused_available(p, grad, exp_avg, exp_avg_sq):
            # the seed from the (CPU) generator: reproducible under torch.manual_seed, no device sync
            seed = int(torch.randint(0, 2 ** 31 - 1, (), generator=self.generator))
            fused_sr_adamw_(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, step=step, seed=seed, stochastic=self.stochastic)
            return
        bias1 = 1.0 - beta1 ** step
        bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
        step_size = lr / bias1
        flat = [t.view(-1) for t in (p, grad, exp_avg, exp_avg_sq)]
        for start in range(0, p.numel(), CHUNK):
            p_c, g_c, m_c, v_c = (t[start:start + CHUNK] for t in flat)
            g = g_c.float()
            m = m_c.float().mul_(beta1).add_(g, alpha=1.0 - beta1)
            v = v_c.float().mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = v.sqrt().div_(bias2_sqrt).add_(eps)   # not in place: v is the state itself when fp32
            w = p_c.float()
            if weight_decay:
                w.mul_(1.0 - lr * weight_decay)
            w.addcdiv_(m, denom, value=-step_size)
            for dst, src in ((p_c, w), (m_c, m), (v_c, v)):
                self._write(dst, src)

    def _write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.dtype == torch.bfloat16 and self.stochastic:
            stochastic_round_(dst, src, self.generator)
        elif dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
