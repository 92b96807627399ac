"""Fast decode (dschat.rollout.decode) against HF generate on tiny random models, fp32, CPU.

Weights are drawn with a large init std so that greedy continuations vary from token to
token (with HF's default 0.02 these tiny models repeat one token, which proves little).
"""
import importlib.util
import itertools
import subprocess
import sys

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from dschat.rollout.decode import FastGenerator, fast_decode_supported, fast_decode_unsupported_reason
from tests.dist_utils import REPO
from tests.dist_utils import test_env as subprocess_env

V = 1024
PAD = 0
P, T = 9, 12


def _bloom(n_head=6, hidden=96, std=0.5, **kw):
    return BloomForCausalLM(BloomConfig(vocab_size=V, hidden_size=hidden, n_layer=2, n_head=n_head,
                                        initializer_range=std, **kw))


def _opt(**kw):
    cfg = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
               max_position_embeddings=64, word_embed_proj_dim=64, init_std=0.5)
    cfg.update(kw)
    return OPTForCausalLM(OPTConfig(**cfg))


def _llama_cfg(cls, **kw):
    cfg = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
               initializer_range=0.2)
    cfg.update(kw)
    return cls(**cfg)


def _neox(**kw):
    cfg = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=64, rotary_pct=0.25, initializer_range=0.3)
    cfg.update(kw)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**cfg))


MODELS = {
    "bloom-6heads": lambda: _bloom(),
    "bloom-8heads-postln": lambda: _bloom(n_head=8, hidden=128, std=0.2,
                                           apply_residual_connection_post_layernorm=True),
    "opt": lambda: _opt(),
    "opt-postln-project": lambda: _opt(do_layer_norm_before=False, word_embed_proj_dim=32),
    "llama-gqa": lambda: LlamaForCausalLM(_llama_cfg(LlamaConfig)),
    "mistral": lambda: MistralForCausalLM(_llama_cfg(MistralConfig, sliding_window=None)),
    "qwen2-bias": lambda: Qwen2ForCausalLM(_llama_cfg(Qwen2Config)),
    # Pythia's layout: partial rotary (a quarter of each head), parallel residual
    "gpt_neox": lambda: _neox(),
    "gpt_neox-serial-nobias": lambda: _neox(use_parallel_residual=False, attention_bias=False,
                                            rotary_pct=0.5, hidden_act="gelu_new"),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                               n_positions=64, initializer_range=0.3)),
}


def make(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]().eval()


def prompts(B=5, width=P, seed=1):
    """Left-padded random prompts of mixed lengths (row 0 full width)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, width), generator=g)
    lens = torch.randint(1, width + 1, (B,), generator=g)
    lens[0] = width
    mask = (torch.arange(width)[None] >= (width - lens)[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def hf_generate(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", T)
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)


def fast(model, **kw):
    return FastGenerator(model, max_prompt_len=16, max_new_tokens=16, **kw)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_hf_with_eos(name):
    model = make(name)
    ids, mask = prompts()
    plain = hf_generate(model, ids, mask, eos_token_id=None)
    # the model must not collapse to one repeated token, or the comparison proves little
    assert sum(len(set(r.tolist())) for r in plain[:, P:]) >= 3 * len(plain)
    eos = int(plain[0, P + 3])                     # row 0 stops after 4 tokens
    ref = hf_generate(model, ids, mask, eos_token_id=eos)
    for numerics in ("fast", "hf"):
        fg = fast(model, numerics=numerics)
        assert torch.equal(fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None,
                                       pad_token_id=PAD), plain), numerics
        out = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=eos, pad_token_id=PAD)
        assert out.shape == ref.shape and torch.equal(out, ref), numerics
    assert (ref[0, P + 4:] == PAD).all()


@pytest.mark.parametrize("name", ["bloom-6heads", "opt", "llama-gqa", "gpt_neox", "gpt2"])
def test_step_logits_match_hf_forward(name):
    model = make(name)
    ids, mask = prompts(B=4)
    fg = fast(model)
    seen = {}
    fg.step_callback = lambda step, logits: seen.__setitem__(step, logits.clone())
    out = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD)
    full = torch.cat([mask, torch.ones(4, T, dtype=torch.long)], 1)
    pos = None
    if not name.startswith(("bloom", "opt")):     # they derive positions from the mask themselves
        pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 1)
    ref = model(out, attention_mask=full, position_ids=pos).logits
    for step in range(T):
        torch.testing.assert_close(seen[step], ref[:, P - 1 + step], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["bloom-6heads", "llama-gqa"])
@pytest.mark.parametrize("attn", ["sdpa", "bmm", "triton"])
def test_decode_attention_paths_match_hf(name, attn):
    """Every decode attention path (Triton's falls back to its reference without CUDA)."""
    model = make(name)
    ids, mask = prompts()
    ref = hf_generate(model, ids, mask, eos_token_id=None)
    out = fast(model, attn_impl=attn).generate(ids, mask, max_new_tokens=T, eos_token_id=None,
                                               pad_token_id=PAD)
    assert torch.equal(out, ref)


def test_min_new_tokens_and_eos_list_match_hf():
    model = make("bloom-6heads")
    ids, mask = prompts()
    eos = list(range(4, V, 3))                      # a third of the vocabulary ends a row
    ref = hf_generate(model, ids, mask, eos_token_id=eos, min_new_tokens=5)
    out = fast(model).generate(ids, mask, max_new_tokens=T, min_new_tokens=5, eos_token_id=eos,
                               pad_token_id=PAD)
    assert torch.equal(out, ref)
    assert not torch.isin(out[:, P:P + 5], torch.tensor(eos)).any()


@pytest.mark.parametrize("name", ["bloom-6heads", "opt", "llama-gqa", "gpt_neox", "gpt2"])
def test_refill_in_place_then_refresh(name):
    model, other = make(name, seed=0), make(name, seed=1)
    ids, mask = prompts()
    fg = fast(model, fuse_qkv=True)
    before = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q.data)
    fg.refresh()
    after = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, eos_token_id=None)
    assert torch.equal(after, ref) and not torch.equal(after, before)


def test_reallocated_tensor_is_rebound_by_refresh():
    model = make("opt")
    ids, mask = prompts()
    fg = fast(model, fuse_qkv=True)
    fg.generate(ids, mask, max_new_tokens=4, eos_token_id=None, pad_token_id=PAD)
    layer = model.model.decoder.layers[0]
    with torch.no_grad():
        layer.fc1.weight.data = layer.fc1.weight.data * 2     # new storage, not in place
        layer.self_attn.q_proj.weight.data = layer.self_attn.q_proj.weight.data * -1
    fg.refresh()
    out = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(out, hf_generate(model, ids, mask, eos_token_id=None))


def test_sampling_reproducible_and_top_k_1_is_greedy():
    model = make("bloom-6heads")
    ids, mask = prompts()
    fg = fast(model)
    kw = dict(max_new_tokens=T, eos_token_id=None, pad_token_id=PAD, do_sample=True)
    a = fg.generate(ids, mask, generator=torch.Generator().manual_seed(7), **kw)
    b = fg.generate(ids, mask, generator=torch.Generator().manual_seed(7), **kw)
    c = fg.generate(ids, mask, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD)
    k1 = fg.generate(ids, mask, top_k=1, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(k1, greedy)
    tiny_p = fg.generate(ids, mask, top_p=1e-6, temperature=0.7,
                         generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(tiny_p, greedy)
    for extra in (dict(top_k=50, top_p=0.9, temperature=0.7), dict(top_p=0.8), dict(top_k=5)):
        out = fg.generate(ids, mask, generator=torch.Generator().manual_seed(3), **extra, **kw)
        assert out.shape == greedy.shape and torch.equal(out[:, :P], ids)
        assert out.min() >= 0 and out.max() < V


def test_top_k_samples_stay_in_top_k():
    model = make("llama-gqa")
    ids, mask = prompts(B=2)
    fg = fast(model)
    seen = {}
    fg.step_callback = lambda step, logits: seen.__setitem__(step, logits.clone())
    out = fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD,
                      do_sample=True, top_k=3, generator=torch.Generator().manual_seed(0))
    for step in range(T):
        top3 = seen[step].topk(3, dim=-1).indices
        assert (top3 == out[:, P + step, None]).any(-1).all()


def test_batch_buckets_and_chunks():
    model = make("llama-gqa")
    ids, mask = prompts(B=5)
    ref = hf_generate(model, ids, mask, eos_token_id=None)
    for buckets in ((1, 2, 8), (1, 2)):              # dummy rows; more rows than the largest bucket
        fg = FastGenerator(model, max_prompt_len=P, max_new_tokens=T, batch_buckets=buckets)
        assert torch.equal(fg.generate(ids, mask, eos_token_id=None, pad_token_id=PAD), ref)
    fg.release()
    assert torch.equal(fg.generate(ids, mask, eos_token_id=None, pad_token_id=PAD), ref)
    with pytest.raises(ValueError):
        fg.generate(torch.cat([ids, ids], 1), torch.cat([mask, mask], 1), eos_token_id=None,
                    pad_token_id=PAD)


def test_key_start_marks_each_rows_first_visible_slot():
    """The slot each row's decode attention starts from (the Triton kernel skips the padding
    before it): the first 1 of the mask, not the pad count (a mask with a hole keeps the hole
    in the bias), and the last prompt slot for the bucket's dummy rows."""
    model = make("bloom-6heads")
    ids, mask = prompts(B=5)
    mask[2] = torch.tensor([0] * (P - 6) + [1, 0, 1, 1, 0, 1])
    fg = FastGenerator(model, max_prompt_len=P, max_new_tokens=T, batch_buckets=(8,))
    fg.generate(ids, mask, eos_token_id=None, pad_token_id=PAD)
    first = [int(torch.nonzero(row)[0]) for row in mask] + [P - 1] * 3
    assert fg._ws.key_start.tolist() == first
    assert first[2] == P - 6 and first[0] == 0


def test_supported_configs():
    assert fast_decode_supported(make("bloom-6heads"))
    assert fast_decode_supported(make("llama-gqa"))
    assert fast_decode_supported(make("gpt_neox"))
    assert fast_decode_supported(make("gpt2"))
    per_layer = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2,
                                           scale_attn_by_inverse_layer_idx=True))
    assert "per layer" in fast_decode_unsupported_reason(per_layer)
    # a learned position table must hold prompt + answer
    assert "position table (64)" in fast_decode_unsupported_reason(make("gpt2"), max_total_len=65)
    assert "position table (64)" in fast_decode_unsupported_reason(make("opt"), max_total_len=65)
    assert fast_decode_supported(make("opt"), max_total_len=64)
    windowed = MistralForCausalLM(_llama_cfg(MistralConfig, sliding_window=8))
    assert "sliding window" in fast_decode_unsupported_reason(windowed, max_total_len=32)
    assert fast_decode_supported(windowed, max_total_len=8)
    dynamic = LlamaForCausalLM(_llama_cfg(LlamaConfig, rope_scaling={"rope_type": "dynamic",
                                                                      "factor": 2.0}))
    assert not fast_decode_supported(dynamic)
    with pytest.raises(ValueError):
        FastGenerator(windowed, max_prompt_len=16, max_new_tokens=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [None, 0, 1, 2])   # None: 3 on compute capability 9+
def test_cuda_graph_matches_eager_and_hf(pdl):
    from dschat.rollout.kernels import KernelOptions
    opts = KernelOptions(pdl=pdl)                # programmatic dependent launch modes
    torch.manual_seed(0)
    model = _bloom().cuda().eval()
    ids, mask = (t.cuda() for t in prompts())
    ref = hf_generate(model, ids, mask, eos_token_id=None)
    graphs = FastGenerator(model, max_prompt_len=16, max_new_tokens=16, use_cuda_graph=True, kernel_options=opts)
    eager = FastGenerator(model, max_prompt_len=16, max_new_tokens=16, use_cuda_graph=False, kernel_options=opts)
    kw = dict(max_new_tokens=T, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(graphs.generate(ids, mask, **kw), ref)
    assert torch.equal(eager.generate(ids, mask, **kw), ref)

    def gen():
        return torch.Generator(device="cuda").manual_seed(5)
    a = graphs.generate(ids, mask, do_sample=True, generator=gen(), **kw)
    b = graphs.generate(ids, mask, do_sample=True, generator=gen(), **kw)
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["opt", "llama-gqa", "qwen2-bias", "gpt_neox", "gpt_neox-serial-nobias",
                                  "gpt2"])
def test_cuda_graph_every_family_matches_hf(name):
    """The other families' blocks through the captured step (Triton attention, fused K/V
    write where the block has it, tuned linears): fp32 greedy tokens equal HF's."""
    model = make(name).cuda()
    ids, mask = (t.cuda() for t in prompts())
    ref = hf_generate(model, ids, mask, eos_token_id=None)
    fg = FastGenerator(model, max_prompt_len=16, max_new_tokens=16, use_cuda_graph=True)
    assert torch.equal(fg.generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD), ref)


def _options(**changes):
    """The kernel options in force with `changes`, for a with-block."""
    import dataclasses

    from dschat.rollout import kernels as dt
    return dt.use_options(dataclasses.replace(dt.options(), **changes))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_match_reference():
    from dschat.rollout import kernels as dt
    if not dt.available():
        pytest.skip("Triton not importable")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for rms in (False, True):
            y, r = (torch.randn(16, 1024, device="cuda", generator=g).to(dtype) for _ in range(2))
            w, b = (torch.randn(1024, device="cuda", generator=g).to(dtype) for _ in range(2))
            got = dt.add_norm(y, r, w, None if rms else b, 1e-5, rms)
            ref = dt.add_norm_ref(y, r, w, None if rms else b, 1e-5, rms)
            for a, e in zip(got, ref):
                torch.testing.assert_close(a.float(), e.float(), atol=tol, rtol=tol)
        y = torch.randn(16, 4096, device="cuda", generator=g).to(dtype) * 3
        same = (dt.hf_gelu(y) == dt.hf_gelu_ref(y)).float().mean().item()
        # libdevice tanhf vs PyTorch's tanh: 99.47% of bf16 outputs equal on the H200
        assert same > 0.99, f"HF-order GELU kernel matches HF's eager ops on {same:.4%}"
        for B, Hkv, G, D, L, Hb in [(16, 16, 1, 64, 512, 16), (4, 8, 4, 128, 320, 1),
                                     (16, 32, 1, 128, 512, 32), (2, 4, 1, 80, 256, 4)]:
            kv = torch.randn(B, Hkv, L, 2, D, device="cuda", generator=g).to(dtype)
            q = torch.randn(B, Hkv, G + 1, D, device="cuda", generator=g).to(dtype)[:, :, :G]
            kb = torch.randn(B, Hb, L, device="cuda", generator=g).to(dtype)
            kb[0, :, :7] = torch.finfo(dtype).min
            # PDL 3 (the default on compute capability 9+) adds the L2 prefetch of the first
            # cached slots (pos 0: slot 0 only); head_dim 80 through the padded kernel
            for p, pdl in itertools.product((0, 63, 200, L - 1), (1, None)):
                with _options(pdl=pdl, attn_pad_head_dim=D == 80):
                    pos = torch.tensor([p], device="cuda")
                    torch.testing.assert_close(dt.decode_attention(q, kv, kb, pos, 0.1).float(),
                                               dt.decode_attention_ref(q, kv, kb, pos, 0.1).float(),
                                               atol=tol, rtol=tol)
                    new = torch.randn(B, Hkv, 2, D, device="cuda", generator=g).to(dtype)
                    kv_fused, kv_ref = kv.clone(), kv.clone()
                    got = dt.decode_attention(q, kv_fused, kb, pos, 0.1, new_kv=new)
                    dt.write_kv_ref(kv_ref, new, pos)
                    assert torch.equal(kv_fused, kv_ref)
                    want = dt.decode_attention_ref(q, kv_ref, kb, pos, 0.1).float()
                    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
                    # row 1's left padding skipped (key_start): the same bits as reading it
                    kb_pad = kb.clone()
                    kb_pad[1, :, :min(p, 150)] = torch.finfo(dtype).min
                    ks = torch.zeros(B, dtype=torch.int32, device="cuda")
                    ks[0], ks[1] = min(p, 7), min(p, 150)
                    kv_x, kv_y = kv.clone(), kv.clone()
                    got_x = dt.decode_attention(q, kv_x, kb_pad, pos, 0.1, new_kv=new, key_start=ks)
                    got_y = dt.decode_attention(q, kv_y, kb_pad, pos, 0.1, new_kv=new)
                    assert torch.equal(got_x, got_y) and torch.equal(kv_x, kv_ref)
                    # the previous launch rule at head_dim 64 (2 warps over 128-key blocks)
                    if D == 64 and G == 1:
                        with _options(attn_warps=2, attn_block_n=128):
                            kv_x = kv.clone()
                            got_x = dt.decode_attention(q, kv_x, kb, pos, 0.1, new_kv=new)
                        assert torch.equal(kv_x, kv_ref)
                        torch.testing.assert_close(got_x.float(), want, atol=tol, rtol=tol)
                    # the tensor-core kernel's other p.V rounding (attn_pv_low) than the default
                    if D >= 128 and dtype == torch.bfloat16:
                        with _options(attn_pv_low=not dt.options().attn_pv_low):
                            kv_x = kv.clone()
                            got_x = dt.decode_attention(q, kv_x, kb, pos, 0.1, new_kv=new)
                        assert torch.equal(kv_x, kv_ref)
                        torch.testing.assert_close(got_x.float(), want, atol=tol, rtol=tol)
        # decode linears: every Triton candidate, and "auto"'s timed choice, against F.linear,
        # in the default programmatic-dependent-launch mode and with the weight prefetch (2)
        for (M, N, K), pdl in itertools.product([(16, 1024, 4096), (1, 3072, 1024)], (None, 1, 2)):
            with _options(pdl=pdl):
                x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
                w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
                b, r, nw, nb = (torch.randn(n, device="cuda", generator=g).to(dtype) for n in (N, M * N, N, N))
                r = r.view(M, N)
                want_lin = dt.linear_ref(x, w, b).float()
                want = [t.float() for t in dt.add_norm_ref(dt.linear_ref(x, w, b), r, nw, nb, 1e-5, False)]
                tma = dt.linears._tma_ok(x, w)     # bf16 / fp16 on Hopper: the TMA candidates too
                for cfg in [None] + list(dt.linears._linear_candidates(K, parts=True, tma=tma).values())[1:]:
                    with _options(linear_force={"linear+norm": cfg}):
                        for a, e in zip(dt.linear_add_norm(x, w, b, r, nw, nb, 1e-5, False), want):
                            torch.testing.assert_close(a.float(), e, atol=tol * 4, rtol=tol)
                # an x TMA cannot address (rows 2 (K + 1) bytes apart) takes the pointer loads
                x_odd = torch.zeros(M, K + 1, device="cuda", dtype=dtype)[:, :K].copy_(x)
                for cfg in [None] + list(dt.linears._linear_candidates(K, parts=False, tma=tma).values())[1:]:
                    with _options(linear_force={"linear": cfg}):
                        torch.testing.assert_close(dt.tuned_linear(x, w, b).float(), want_lin, atol=tol * 4, rtol=tol)
                        torch.testing.assert_close(dt.tuned_linear(x_odd, w, b).float(), want_lin,
                                                   atol=tol * 4, rtol=tol)
                torch.testing.assert_close(dt.tuned_linear(x, w, b).float(), want_lin, atol=tol * 4, rtol=tol)
        # argmax: torch's index exactly, ties included
        x = torch.randint(0, 50, (16, 250880), device="cuda", generator=g).to(dtype)
        assert torch.equal(dt.argmax(x), x.argmax(-1))
        # rotary in place, bit for bit HF's rounding: LLaMA's q and k heads, and GPT-NeoX's
        # strided [q, k] rows of the fused QKV output with partial rotary
        for B, H, D, R, llama in ((16, 32, 128, 128, True), (16, 16, 128, 32, False), (4, 8, 80, 20, False)):
            qkv = torch.randn(B, H, 3, D, device="cuda", generator=g).to(dtype)
            ang = (torch.rand(B, R // 2, device="cuda", generator=g) * 500).repeat(1, 2)
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            sin = torch.cat((-sin[:, :R // 2], sin[:, R // 2:]), dim=-1)
            view = (lambda t: t.view(B, 3 * H, 1, D)[:, :2 * H]) if llama else (lambda t: t[:, :, 0:2])
            got, want = qkv.clone(), qkv.clone()
            dt.rope_(view(got), cos, sin)
            dt.rope_ref_(view(want), cos, sin)
            assert torch.equal(got, want) and not torch.equal(got, qkv), (dtype, D, R, llama)
        # GPT-NeoX's parallel residual: (y + y2) + r and two LayerNorms of the sum in one kernel,
        # from a linear's output or from its split-K partials
        M, N, K = 16, 2048, 8192
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
        b, y2, r, w1, b1, w2, b2 = (torch.randn(n, device="cuda", generator=g).to(dtype)
                                    for n in (N, M * N, M * N, N, N, N, N))
        y2, r = y2.view(M, N), r.view(M, N)
        want = [t.float() for t in dt.add_norm_ref(dt.linear_ref(x, w, b), r, w1, b1, 1e-5, False, y2,
                                                    (w2, b2, 1e-6))]
        for cfg in [None] + list(dt.linears._linear_candidates(K, parts=True).values())[1:]:
            with _options(linear_force={"linear+norm": cfg}):
                got = dt.linear_add_norm(x, w, b, r, w1, b1, 1e-5, False, y2, (w2, b2, 1e-6))
                assert len(got) == 3
                for a, e in zip(got, want):
                    torch.testing.assert_close(a.float(), e, atol=tol * 4, rtol=tol)
        # GPT-2's gelu_new in one kernel against HF's module (libdevice tanhf vs PyTorch's tanh
        # may differ in the last bit, as for Bloom's GELU above)
        from transformers.activations import NewGELUActivation
        y = torch.randn(16, 6400, device="cuda", generator=g).to(dtype) * 3
        same = (dt.new_gelu(y) == NewGELUActivation()(y)).float().mean().item()
        assert same > 0.99, f"gelu_new kernel matches HF's module on {same:.4%}"
        # a Conv1D weight [K, N] read through its transpose (GPT-2): every candidate
        for N, K in ((4800, 1600), (1600, 6400)):
            x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
            w = (torch.randn(K, N, device="cuda", generator=g) / K ** 0.5).to(dtype).t()
            b, r, nw, nb = (torch.randn(n, device="cuda", generator=g).to(dtype) for n in (N, M * N, N, N))
            r = r.view(M, N)
            want_lin = dt.linear_ref(x, w, b).float()
            for cfg in [None] + list(dt.linears._linear_candidates(K, parts=False, transposed=True).values())[1:]:
                with _options(linear_force={"linear": cfg}):
                    torch.testing.assert_close(dt.tuned_linear(x, w, b).float(), want_lin, atol=tol * 4, rtol=tol)
            want = [t.float() for t in dt.add_norm_ref(dt.linear_ref(x, w, b), r, nw, nb, 1e-5, False)]
            for cfg in list(dt.linears._linear_candidates(K, parts=True, transposed=True).values())[1:]:
                with _options(linear_force={"linear+norm": cfg}):
                    for a, e in zip(dt.linear_add_norm(x, w, b, r, nw, nb, 1e-5, False), want):
                        torch.testing.assert_close(a.float(), e, atol=tol * 4, rtol=tol)
        # LLaMA's SiLU(gate) * up in one kernel: every candidate against HF's op order
        N, K = 11008, 4096
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        wg, wu = ((torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype) for _ in range(2))
        want = dt.gated_ref(x, wg, None, wu, None)
        cands = dt.linears._linear_candidates(K, parts=False, tma=dt.linears._tma_ok(x, wg), weights=2)
        for cfg in [None] + list(cands.values())[1:]:
            with _options(linear_force={"gated": cfg}):
                torch.testing.assert_close(dt.gated_mlp(x, wg, None, wu, None).float(), want.float(),
                                           atol=tol * 4, rtol=tol)
        # exact (erf) GELU in the linear's epilogue against nn.GELU after F.linear
        N, K = 8192, 2048
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
        b = torch.randn(N, device="cuda", generator=g).to(dtype)
        want = dt.linear_ref(x, w, b, "erf").float()
        cands = dt.linears._linear_candidates(K, parts=False, tma=dt.linears._tma_ok(x, w))
        for cfg in [None] + list(cands.values())[1:]:
            with _options(linear_force={"linear": cfg}):
                torch.testing.assert_close(dt.tuned_linear(x, w, b, gelu="erf").float(), want, atol=tol * 4, rtol=tol)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernels_in_the_cpu_interpreter():
    """The Triton decode kernels (attention with and without the fused K/V write, add+norm)
    run in Triton's CPU interpreter: equal to their PyTorch references, and FastGenerator on
    the Triton attention gives HF generate's fp32 tokens either way."""
    env = dict(subprocess_env(), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist" / "triton_interpret_decode.py")],
                          # ~9.5 min on the 2-core CI machine (every kernel and six families
                          # through FastGenerator, interpreted): the limit only stops a hang
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_programmatic_dependent_launch_only_on_hopper_cuda(monkeypatch):
    """PDL is a launch attribute of CUDA compute capability 9+: never requested on the CPU
    or in Triton's interpreter, whatever KernelOptions.pdl says."""
    from dschat.rollout import kernels as dt
    for mode in (None, 1, 2, 3):
        with dt.use_options(dt.KernelOptions(pdl=mode)):
            assert dt.launch._pdl_mode(torch.device("cpu")) == 0
            assert dt.launch._pdl_launch(dt.launch._pdl_mode(torch.device("cpu"))) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dt.launch._interpreting() and dt.launch._pdl_mode(torch.device("cuda")) == 0
    assert dt.launch._pdl_launch(2) == {"launch_pdl": True}
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    assert not dt.launch._cuda_at_least(12, 3)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert dt.launch._cuda_at_least(12, 3)


def test_head_dim_not_a_power_of_two(monkeypatch):
    """bloom-3b and pythia-2.8b have head_dim 80 (gpt-neox-20b 96): the Triton decode
    attention pads head_dim to a power-of-two block (KernelOptions.attn_pad_head_dim, the default). With
    the padding off such models decode with baddbmm, and the kernel's entry point answers
    with the reference instead of failing to compile."""
    from dschat.rollout import kernels as dt
    from dschat.rollout.decode import _DecodeBlock
    assert dt.KernelOptions().attn_pad_head_dim
    assert _DecodeBlock.default_attention(80, "fast", True) == "triton"
    assert _DecodeBlock.default_attention(96, "fast", True) == "triton"
    assert _DecodeBlock.default_attention(80, "fast", True, pad_head_dim=False) == "bmm"
    assert _DecodeBlock.default_attention(96, "fast", True, pad_head_dim=False) == "bmm"
    assert _DecodeBlock.default_attention(64, "fast", True) == "triton"
    assert _DecodeBlock.default_attention(128, "fast", True) == "triton"
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 1, 80, generator=g), torch.randn(2, 3, 32, 2, 80, generator=g)
    kb, pos = torch.zeros(2, 1, 32), torch.tensor([20])
    # as in the interpreter, where CPU tensors would otherwise reach the kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with dt.use_options(dt.KernelOptions(attn_pad_head_dim=False)):
        torch.testing.assert_close(dt.decode_attention(q, kv, kb, pos, 0.1),
                                   dt.decode_attention_ref(q, kv, kb, pos, 0.1))
    monkeypatch.delenv("TRITON_INTERPRET")
    model = _bloom(n_head=2, hidden=160)                   # head_dim 80
    ids, mask = prompts()
    assert torch.equal(fast(model).generate(ids, mask, max_new_tokens=T, eos_token_id=None, pad_token_id=PAD),
                       hf_generate(model, ids, mask, eos_token_id=None))


def test_l2_prefetch_lengths():
    """Mode 3's prefetch per program: about KernelOptions.pdl_prefetch bytes as a power of two of whole
    128-byte lines, never past the program's K slice, nothing outside mode 3 or at 0 bytes."""
    from dschat.rollout import kernels as dt
    w = torch.empty(8, 8, dtype=torch.bfloat16)
    assert dt.linears._prefetch_args(3, 32, 4096, w) == {"PF_K": 8192 // (32 * 2), "LINE": 64}
    assert dt.linears._prefetch_args(3, 16, 4096, w)["PF_K"] == 256
    assert dt.linears._prefetch_args(3, 64, 4096, w)["PF_K"] == 64      # below a line per row: one line
    assert dt.linears._prefetch_args(3, 16, 100, w)["PF_K"] == 64       # K slice of 100: one line
    assert dt.linears._prefetch_args(3, 16, 200, w)["PF_K"] == 128
    assert dt.linears._prefetch_args(1, 32, 4096, w)["PF_K"] == 0
    assert dt.linears._prefetch_args(3, 32, 4096, w.float())["LINE"] == 32
    with dt.use_options(dt.KernelOptions(pdl_prefetch=0)):
        assert dt.linears._prefetch_args(3, 32, 4096, w)["PF_K"] == 0
    assert dt.options().pdl_prefetch == 8192
    assert [dt.launch._prefetch_count(n, 1) for n in (0, 1, 15, 16, 17)] == [1, 1, 8, 16, 16]
