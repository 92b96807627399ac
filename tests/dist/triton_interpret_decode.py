"""The decode step's Triton kernels in Triton's CPU interpreter (run with TRITON_INTERPRET=1;
tests/test_decode.py starts it): the attention kernel with and without the fused K/V write
against the PyTorch reference (cache contents and outputs), with the left padding skipped
against reading every slot (bit for bit), the fused add+norm, the decode
linear, then FastGenerator with the Triton attention (and, for Bloom, the Triton linears)
against HF generate (fp32 tokens); the split-K linear summed by the add+norm kernel and
the two-kernel argmax."""
import itertools

import torch
import triton
import triton.language as tl
from transformers import AutoConfig, AutoModelForCausalLM

from dschat.rollout import decode
from dschat.rollout import kernels as dt
from dschat.rollout.kernels import KernelOptions, use_options

assert dt.available() and dt.launch._interpreting()

# kernels against their references: shapes with G = 1 (Bloom) and grouped queries
gen = torch.Generator().manual_seed(0)
ALL_ATTN = ((1, False), (2, False), (4, False), (1, True), (2, True), (4, True))


def check_attention(configs, pv_low=False):
    """(splits, tensor-core dots) each against the reference, with and without the fused
    K/V write; query positions at block and split edges."""
    for S, dot in configs:
        with use_options(KernelOptions(attn_splits=S, attn_dot=dot, attn_pv_low=pv_low)):
            check_attention_one(S)


def check_attention_one(S):
    """One splits configuration, in force: every shape and query position."""
    for B, Hkv, G, D, L, Hb in [(2, 3, 1, 16, 200, 3), (2, 2, 4, 32, 130, 1)]:
        for p in (0, 63, 64, L - 2, L - 1):
            kv = torch.randn(B, Hkv, L, 2, D, generator=gen)
            q = torch.randn(B, Hkv, G, D, generator=gen)
            if p % 2:   # Bloom's fused qkv [B, H, 3, D] ...
                new = torch.randn(B, Hkv, 3, D, generator=gen)[:, :, 1:3]
            else:       # ... and OPT's [B, 3, H, D]
                new = torch.randn(B, 3, Hkv, D, generator=gen)[:, 1:3].transpose(1, 2)
            kb = torch.randn(B, Hb, L, generator=gen)
            kb[0, :, :3] = torch.finfo(kb.dtype).min
            pos = torch.tensor([p])
            torch.testing.assert_close(dt.decode_attention(q, kv, kb, pos, 0.1),
                                       dt.decode_attention_ref(q, kv, kb, pos, 0.1), atol=1e-5, rtol=1e-5)
            kv_fused, kv_ref = kv.clone(), kv.clone()
            got = dt.decode_attention(q, kv_fused, kb, pos, 0.1, new_kv=new)
            dt.write_kv_ref(kv_ref, new, pos)
            assert torch.equal(kv_fused, kv_ref), ("fused K/V write", S, B, G, p)
            torch.testing.assert_close(got, dt.decode_attention_ref(q, kv_ref, kb, pos, 0.1),
                                       atol=1e-5, rtol=1e-5)
            if p in (63, L - 2):
                # row 1's left padding skipped (key_start): bit for bit the same sums
                first = min(p, 150)
                kb[1, :, :first] = torch.finfo(kb.dtype).min
                ks = torch.tensor([3, first], dtype=torch.int32)
                kv_skip, kv_all = kv.clone(), kv.clone()
                got_skip = dt.decode_attention(q, kv_skip, kb, pos, 0.1, new_kv=new, key_start=ks)
                got_all = dt.decode_attention(q, kv_all, kb, pos, 0.1, new_kv=new)
                assert torch.equal(kv_skip, kv_all) and torch.equal(got_skip, got_all), ("skip", S, G, p)


check_attention(ALL_ATTN)
# the tensor-core kernel's p.V with p rounded to the cache dtype
check_attention(((1, True), (2, True)), pv_low=True)


def _no_reference(*args, **kwargs):
    raise AssertionError("decode_attention fell back to the PyTorch reference")


def check_padded_head_dim():
    """Head dims that are not a power of two (attn_pad_head_dim: one block of the next power
    of two, extra lanes masked), through the kernel itself (the reference is disabled while it
    runs): plain, split (with the combine kernel), fused K/V write, grouped queries."""
    ref, write = dt.decode_attention_ref, dt.write_kv_ref
    for (S, dot), (B, Hkv, G, D, L, Hb) in itertools.product(
            ((1, False), (2, False), (2, True)),
            ((2, 3, 1, 24, 150, 3), (2, 2, 4, 40, 130, 1))):
        opts = KernelOptions(attn_splits=S, attn_dot=dot, attn_pad_head_dim=True)
        for p in (0, 64, L - 1):
            kv = torch.randn(B, Hkv, L, 2, D, generator=gen)
            q = torch.randn(B, Hkv, G, D, generator=gen)
            new = torch.randn(B, Hkv, 3, D, generator=gen)[:, :, 1:3]
            kb = torch.randn(B, Hb, L, generator=gen)
            pos = torch.tensor([p])
            kv_ref = kv.clone()
            write(kv_ref, new, pos)
            want_plain, want_fused = ref(q, kv, kb, pos, 0.1), ref(q, kv_ref, kb, pos, 0.1)
            dt.attention.decode_attention_ref = dt.attention.write_kv_ref = _no_reference
            try:
                with use_options(opts):
                    got_plain = dt.decode_attention(q, kv, kb, pos, 0.1)
                    kv_fused = kv.clone()
                    got_fused = dt.decode_attention(q, kv_fused, kb, pos, 0.1, new_kv=new)
            finally:
                dt.attention.decode_attention_ref, dt.attention.write_kv_ref = ref, write
            torch.testing.assert_close(got_plain, want_plain, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_fused, want_fused, atol=1e-5, rtol=1e-5)
            assert torch.equal(kv_fused, kv_ref), ("padded fused K/V write", S, D, p)


check_padded_head_dim()


def check_rope():
    """The rotary kernel against `rope_ref_` (bit for bit in fp32; in bf16 within rounding,
    as the interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even, so
    bit equality in bf16 is the GPU kernel test's): LLaMA's q and k
    heads ([B, Hq+Hkv, 1, D], all dims) and GPT-NeoX's per-head [q, k] rows of the fused QKV
    output ([B, H, 2, D] strided, partial rotary) with v and the pass-through dims untouched."""
    for dtype in (torch.float32, torch.bfloat16):
        for B, H, layout, D, R in ((3, 6, "llama", 16, 16), (2, 4, "neox", 32, 8), (2, 4, "neox", 24, 12)):
            qkv = torch.randn(B, H, 3, D, generator=gen).to(dtype)
            ang = torch.randn(B, R // 2, generator=gen).repeat(1, 2)
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            sin = torch.cat((-sin[:, :R // 2], sin[:, R // 2:]), dim=-1)
            got, want = qkv.clone(), qkv.clone()
            view = (lambda t: t.view(B, 3 * H, 1, D)[:, :2 * H]) if layout == "llama" else (lambda t: t[:, :, 0:2])
            dt.elementwise.rope_ref_, ref = _no_reference, dt.rope_ref_
            try:
                dt.rope_(view(got), cos, sin)
            finally:
                dt.elementwise.rope_ref_ = ref
            ref(view(want), cos, sin)
            if dtype == torch.float32:
                assert torch.equal(got, want), (dtype, layout, D, R)
            else:
                torch.testing.assert_close(got, want, atol=0.02, rtol=0.016)
                rotated = torch.zeros(qkv.shape, dtype=torch.bool)
                view(rotated)[..., :R] = True
                assert torch.equal(got[~rotated], qkv[~rotated])
            assert not torch.equal(got, qkv)


check_rope()
for rms in (False, True):
    y, r, w, b = torch.randn(4, 96, generator=gen), torch.randn(4, 96, generator=gen), \
        torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    for a, e in zip(dt.add_norm(y, r, w, None if rms else b, 1e-5, rms),
                    dt.add_norm_ref(y, r, w, None if rms else b, 1e-5, rms)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
# GPT-NeoX's parallel residual: (y + y2) + r, two LayerNorms of it
y2, w2, b2 = torch.randn(4, 96, generator=gen), torch.randn(96, generator=gen), torch.randn(96, generator=gen)
got = dt.add_norm(y, r, w, b, 1e-5, False, y2, (w2, b2, 1e-6))
assert len(got) == 3
for a, e in zip(got, dt.add_norm_ref(y, r, w, b, 1e-5, False, y2, (w2, b2, 1e-6))):
    torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def check_linears():
    for M, N, K in [(3, 40, 70), (16, 96, 256), (1, 17, 33)]:        # the decode linear
        for gelu, bias in ((False, False), (False, True), (True, True)):
            x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen) / K ** 0.5
            b = torch.randn(N, generator=gen) if bias else None
            for bn in (16, 32):
                with use_options(KernelOptions(linear_block_n=bn, linear_block_k=32)):
                    torch.testing.assert_close(dt.linear(x, w, b, gelu), dt.linear_ref(x, w, b, gelu),
                                               atol=1e-4, rtol=1e-4)
    # a Conv1D weight [K, N] read through its transpose (GPT-2), exact GELU in the epilogue
    for M, N, K in [(3, 40, 70), (16, 96, 256)]:
        x, w = torch.randn(M, K, generator=gen), torch.randn(K, N, generator=gen).t() / K ** 0.5
        b = torch.randn(N, generator=gen)
        for gelu, cfg in itertools.product((False, "erf"), [(16, 32), (64, 32, 4, 2)]):
            with use_options(KernelOptions(linear_force={"linear": cfg})):
                torch.testing.assert_close(dt.tuned_linear(x, w, b, gelu=gelu), dt.linear_ref(x, w, b, gelu),
                                           atol=1e-4, rtol=1e-4)
        r, nw, nb = torch.randn(M, N, generator=gen), torch.randn(N, generator=gen), torch.randn(N, generator=gen)
        with use_options(KernelOptions(linear_force={"linear+norm": (2, 16, 32)})):
            for a, e in zip(dt.linear_add_norm(x, w, b, r, nw, nb, 1e-5, False),
                            dt.add_norm_ref(dt.linear_ref(x, w, b), r, nw, nb, 1e-5, False)):
                torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    # LLaMA's SiLU(gate) * up in one kernel reading both weights
    for M, N, K in [(3, 40, 70), (16, 96, 256)]:
        x = torch.randn(M, K, generator=gen)
        wg, wu = (torch.randn(N, K, generator=gen) / K ** 0.5 for _ in range(2))
        for bias, cfg in itertools.product((False, True), [(16, 32), (32, 64, 4, 2)]):
            bg, bu = (torch.randn(N, generator=gen), torch.randn(N, generator=gen)) if bias else (None, None)
            with use_options(KernelOptions(linear_force={"gated": cfg})):
                torch.testing.assert_close(dt.gated_mlp(x, wg, bg, wu, bu), dt.gated_ref(x, wg, bg, wu, bu),
                                           atol=1e-4, rtol=1e-4)
    y = torch.randn(5, 333, generator=gen) * 3         # GPT-2's gelu_new, Bloom's GELU in one kernel
    torch.testing.assert_close(dt.new_gelu(y), dt.new_gelu_ref(y), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dt.hf_gelu(y), dt.hf_gelu_ref(y), atol=1e-5, rtol=1e-5)
    # split-K partials summed by the add+norm kernel (+ the linear's bias) == add_norm(F.linear)
    for M, N, K in [(3, 40, 70), (16, 96, 256)]:
        for splits, bn, bk, *ws in ((1, 16, 32), (2, 32, 32), (3, 16, 16), (8, 16, 32, 8, 4)):
            for rms, bias in ((False, True), (True, False)):
                x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen) / K ** 0.5
                b = torch.randn(N, generator=gen) if bias else None
                r, nw, nb = torch.randn(M, N, generator=gen), torch.randn(N, generator=gen), \
                    None if rms else torch.randn(N, generator=gen)
                want = dt.add_norm_ref(dt.linear_ref(x, w, b), r, nw, nb, 1e-5, rms)
                force = {"linear+norm": (splits, bn, bk, *ws), "linear": (bn, bk, *ws)}
                with use_options(KernelOptions(linear_force=force)):
                    for a, e in zip(dt.linear_add_norm(x, w, b, r, nw, nb, 1e-5, rms), want):
                        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(dt.tuned_linear(x, w, b), dt.linear_ref(x, w, b),
                                               atol=1e-4, rtol=1e-4)
    # the TMA linear (16-bit weights; tiles by Hopper's tensor memory accelerator) in both
    # orientations, with bias and either GELU, from an x whose rows TMA cannot address (read
    # by pointer), and as split-K partials into the add+norm kernel; against the same ops in
    # bf16, so only the accumulation order differs
    bf = torch.bfloat16
    for (M, N, K), swap, (bn, bk) in itertools.product([(3, 40, 96), (16, 100, 256)], (0, 1), [(32, 32), (64, 64)]):
        x = torch.randn(M, K, generator=gen).to(bf)
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(bf)
        b = torch.randn(N, generator=gen).to(bf)
        x_odd = torch.randn(M, K + 3, generator=gen).to(bf)[:, :K]      # rows 2 (K + 3) bytes apart
        assert dt.linears._tma_ok(x, w)
        for xx, gelu in ((x, False), (x, "tanh"), (x_odd, "erf")):
            with use_options(KernelOptions(linear_force={"linear": ("tma", 1, swap, bn, bk)})):
                torch.testing.assert_close(dt.tuned_linear(xx, w, b, gelu=gelu).float(),
                                           dt.linear_ref(xx, w, b, gelu).float(), atol=4e-2, rtol=2e-2)
        r, nw, nb = (torch.randn(*s, generator=gen).to(bf) for s in ((M, N), (N,), (N,)))
        want = dt.add_norm_ref(dt.linear_ref(x, w, b), r, nw, nb, 1e-5, False)
        for splits in (1, 3):
            with use_options(KernelOptions(linear_force={"linear+norm": ("tma", splits, swap, bn, bk)})):
                for a, e in zip(dt.linear_add_norm(x, w, b, r, nw, nb, 1e-5, False), want):
                    torch.testing.assert_close(a.float(), e.float(), atol=8e-2, rtol=2e-2)
        # a weight TMA cannot address (base 2 bytes off 16) gets cuBLAS's path, not a TMA launch
        w_odd = torch.empty(N * K + 1, dtype=bf)[1:].view(N, K).copy_(w)
        assert not dt.linears._tma_ok(x, w_odd)
        with use_options(KernelOptions(linear_force={"linear": ("tma", 1, swap, bn, bk)})):
            assert torch.equal(dt.tuned_linear(x, w_odd, b), dt.linear_ref(x, w_odd, b))
        u = (torch.randn(N, K, generator=gen) / K ** 0.5).to(bf)             # LLaMA's gate and up
        for xx, bias in ((x, None), (x_odd, b)):
            with use_options(KernelOptions(linear_force={"gated": ("tma", 1, swap, bn, bk)})):
                torch.testing.assert_close(dt.gated_mlp(xx, w, bias, u, bias).float(),
                                           dt.gated_ref(xx, w, bias, u, bias).float(), atol=8e-2, rtol=2e-2)


@triton.jit
def _no_wait(PDL: tl.constexpr):
    pass


check_linears()
# again in the programmatic-dependent-launch layout (PDL mode 2: the linears read their first
# weight tile before the grid-dependency wait); the interpreter has no grid dependency
# control, so the wait is a no-op here and the kernels' arithmetic is what is checked
# (the launch helpers as the linear and add+norm modules hold them)
real = {(mod, name): getattr(mod, name) for mod in (dt.linears, dt.norm)
        for name in ("_pdl_enter", "_pdl_mode", "_pdl_launch")}
for mod in (dt.linears, dt.norm):
    mod._pdl_enter, mod._pdl_mode, mod._pdl_launch = _no_wait, (lambda device: 2), (lambda mode: {})
check_linears()
for (mod, name), value in real.items():
    setattr(mod, name, value)
# argmax: the first of tied maxima (ties within and across slices), all -inf rows, bf16
x = torch.randint(0, 7, (5, 9000), generator=gen).float()
x[1] = float("-inf")
x[2, 8999] = 100.0
x[3, 4096] = x[3, 12] = 50.0
for t in (x, x.bfloat16(), x[:, :1000], x[:1]):
    assert torch.equal(dt.argmax(t), t.argmax(-1)), (dt.argmax(t), t.argmax(-1))
print("kernels match their references")
CONFIGS = {
    # large init std: greedy continuations that vary (tests/test_decode.py does the same)
    "bloom": dict(vocab_size=300, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.5),
    "opt": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                max_position_embeddings=64, word_embed_proj_dim=64, init_std=0.5),
    # grouped queries (2 query heads per K/V head); rotary kernel, fused K/V write from [B, Hq+2Hkv, D]
    "llama": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, initializer_range=0.5),
    # partial rotary, parallel residual; q and the new K/V read from the QKV output in place
    "gpt_neox": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, rotary_pct=0.25, initializer_range=0.5),
    # head_dim 20, not a power of two: decoded with attn_pad_head_dim on (the default)
    "bloom-hd20": dict(vocab_size=300, hidden_size=40, n_layer=2, n_head=2, initializer_range=0.5),
    # Conv1D weights read through transposed views (the linears stay in PyTorch)
    "gpt2": dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.5),
}
for family, kwargs in CONFIGS.items():
    cfg = AutoConfig.for_model(family.split("-")[0], **kwargs)
    cfg.pad_token_id, cfg.eos_token_id = 0, 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    ids[2, :9] = 0
    mask[2, :9] = 0
    kw = dict(max_new_tokens=10, min_new_tokens=10, pad_token_id=0, eos_token_id=1)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    outs = {}
    for fused in (False, True):
        # the fused run also takes the split programs and the tensor-core dots
        opts = KernelOptions(fuse_kv_write=True, attn_splits=2, attn_dot=True) if fused \
            else KernelOptions(fuse_kv_write=False)
        fg = decode.FastGenerator(model, max_prompt_len=12, max_new_tokens=10, attn_impl="triton",
                                  use_triton=True, kernel_options=opts)
        steps = []
        fg.step_callback = lambda s, logits: steps.append(logits.clone())
        outs[fused] = (fg.generate(ids, mask, **kw), torch.stack(steps))
        print(family, "fused", fused, "tokens equal HF:", torch.equal(outs[fused][0], want))
    # every decode linear in a Triton kernel: the fixed rule (Bloom), and "auto" forced to
    # Triton for plain linears and split-K partials summed by the add+norm kernel
    for lin_mode, force in ([(True, None)] if family == "bloom" else []) + [
            ("auto", {"linear": (16, 32), "linear+norm": (2, 16, 32), "gated": (16, 32)})]:
        fg = decode.FastGenerator(model, max_prompt_len=12, max_new_tokens=10, attn_impl="triton",
                                  use_triton=True,
                                  kernel_options=KernelOptions(decode_linear=lin_mode, linear_force=force))
        got = fg.generate(ids, mask, **kw)
        print(family, "Triton linears", lin_mode, "tokens equal HF:", torch.equal(got, want))
        assert torch.equal(got, want), (family, lin_mode)
    a, b = outs[True][1], outs[False][1]
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a))
    print(family, "max logit diff fused vs not:", (a[fin] - b[fin]).abs().max().item())
    assert torch.equal(outs[True][0], want) and torch.equal(outs[False][0], want), family
    assert len(set(want[:, 12:].flatten().tolist())) > 3, "degenerate continuation"
print("OK")
