"""Fast decode for step-3 generation from a persistent inference replica.

The replica is a plain HF causal LM (no DeepSpeed hooks) whose parameter tensors live at
fixed addresses and are refilled IN PLACE (`p.data.copy_(...)`) after every optimizer step.
`FastGenerator` reads those tensors directly (no copies), so a refill changes what it
computes without any action, with one exception: derived weights. Where a family's
block fuses weights (the concatenated Q/K/V projection of OPT and LLaMA, built when
`fuse_qkv` is on), those live in buffers of their own and are rebuilt by
`FastGenerator.refresh()`. Contract for the caller: after every in-place refill of the
replica, call `refresh()` before the next `generate`. `refresh()` also notices tensors
that were reallocated instead of refilled (new addresses) and then drops the captured
CUDA graphs, which are recaptured on the next `generate`.

How a generate call runs:
- batch rows are padded up to a batch bucket (1, 2, 4, ...); one workspace holds the KV
  cache for the largest bucket seen, sized max_prompt_len + max_new_tokens;
- prefill: one forward over the left-padded prompt with SDPA and an explicit additive
  bias (padding + causal, plus ALiBi for Bloom, built exactly as HF builds it from the
  cumulative attention mask), writing K/V into the cache, logits for the last position;
- decode: a step function of fixed-address buffers only (current token, position and
  step counters as device tensors, KV cache, per-key bias) that attends only over the
  filled part of the cache: the Triton kernel reads the filled length on the device (one
  graph per batch bucket and sampling mode); the baddbmm / SDPA paths use the filled part
  rounded up to a length bucket of 64 keys (one graph per length bucket). Sampling and
  eos/pad/min_new_tokens run on the GPU inside the step. On CUDA each step is replayed
  from a CUDA graph; the host syncs only every `check_every` steps to see whether all
  rows finished (never when min_new_tokens forces the whole length).
- the decode attention defaults to the Triton kernel for head_dim <= 128 and to baddbmm in
  HF's op order above (why: docs/DECODE.md); Bloom's prompt
  runs in HF's eager op order, so the first token's logits equal HF's.

Per-family math (Bloom, OPT, GPT-2, LLaMA / Mistral / Qwen2, GPT-NeoX) lives in `_DecodeBlock`
subclasses registered under the registry's
`fast_decode` key. `fast_decode_supported(model)` says whether a model can use this path;
where it cannot, callers use HF `generate`.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dschat.registry import UnknownModelTypeError, family_of, resolve, unwrap_peft
from dschat.rollout import kernels
from dschat.rollout.kernels import add_norm_ref
from dschat.utils.logging import get_logger
from dschat.utils.tensor_ops import positions_from_mask

logger = get_logger(__name__)

_BLOCKS: dict[str, type] = {}
LENGTH_BUCKET = 64      # attention spans the filled cache rounded up to this many slots
# SDPA backends allowed for the decode step's attention (None: PyTorch's own choice, cuDNN
# on Hopper, whose seeded sampling did not reproduce through captured graphs; the
# memory-efficient kernel reproduces; docs/DECODE.md, section 4).
DECODE_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def register_block(key: str):
    """Class decorator: make a `_DecodeBlock` the fast path for registry key `key`."""
    def deco(cls):
        _BLOCKS[key] = cls
        return cls
    return deco


# --------------------------------------------------------------------------- support

def fast_decode_unsupported_reason(model, *, max_total_len: Optional[int] = None) -> Optional[str]:
    """Why `model` cannot use the fast path (None when it can).

    `max_total_len` (prompt + answer) lets configs with a sliding window be checked: such a
    window is accepted only when it covers the whole sequence.
    """
    model = unwrap_peft(model)
    config = getattr(model, "config", None)
    if config is None:
        return "model has no HF config"
    try:
        fam = family_of(model)
    except UnknownModelTypeError:
        return f"model_type {config.model_type!r} is not in the registry"
    if not fast_decode_supported_block(fam):
        return f"model_type {config.model_type!r} has no fast decode block"
    blocks = resolve(model, fam.blocks)
    if blocks is None or len(blocks) == 0:
        return "model has no transformer blocks at the registry path"
    for mod in model.modules():
        if hasattr(mod, "lora_A"):
            return "model holds unmerged LoRA adapters"
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type == "meta" or p.numel() == 0:
        return "model parameters are not materialized (meta or partitioned)"
    return _BLOCKS[fam.fast_decode].unsupported_reason(model, config, max_total_len)


def build_block(model, **kwargs) -> "_DecodeBlock":
    """The family's decode maths over `model`'s tensors (keywords: _DecodeBlock's)."""
    return _BLOCKS[family_of(model).fast_decode](model, **kwargs)


def fast_decode_supported_block(fam) -> bool:
    """The registry family `fam` has a decode block."""
    return fam.fast_decode is not None and fam.fast_decode in _BLOCKS


def fast_decode_supported(model, *, max_total_len: Optional[int] = None) -> bool:
    """Registry family has a fast decode block and the model's config is supported."""
    return fast_decode_unsupported_reason(model, max_total_len=max_total_len) is None


# --------------------------------------------------------------------------- helpers

def _lin(x, w, b=None):
    return F.linear(x, w, b)


def _min_value(dtype) -> float:
    return torch.finfo(dtype).min


def _alibi_slopes(n_heads: int, device) -> torch.Tensor:
    """ALiBi head slopes (fp32), the geometric series of the ALiBi paper; for head counts
    that are not a power of two the extra heads take every other slope of the next power."""
    p2 = 2 ** math.floor(math.log2(n_heads))
    base = torch.tensor(2.0 ** (-(2.0 ** -(math.log2(p2) - 3))), dtype=torch.float32, device=device)
    slopes = torch.pow(base, torch.arange(1, p2 + 1, dtype=torch.int32, device=device))
    if p2 != n_heads:
        extra = torch.tensor(2.0 ** (-(2.0 ** -(math.log2(2 * p2) - 3))), dtype=torch.float32,
                             device=device)
        n_rest = min(p2, n_heads - p2)
        odd = torch.arange(1, 2 * n_rest, 2, dtype=torch.int32, device=device)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


_EPILOGUE_OK: dict = {}


def _gelu_epilogue_is_tanh(device, dtype) -> bool:
    """Whether torch._addmm_activation(use_gelu=True) computes tanh-GELU here (cuBLASLt's
    bias+GELU epilogue does); checked once per device and dtype on random data."""
    key = (str(device), dtype)
    if key not in _EPILOGUE_OK:
        try:
            # in fp32 (same epilogue), where tanh- and erf-GELU differ far above rounding
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(8, 256, device=device, generator=g)
            w = torch.randn(512, 256, device=device, generator=g) / 8
            b = torch.randn(512, device=device, generator=g)
            y = F.linear(x, w, b)
            ref, erf = F.gelu(y, approximate="tanh"), F.gelu(y)
            got = torch._addmm_activation(b, x, w.t(), use_gelu=True)
            _EPILOGUE_OK[key] = bool((got - ref).abs().max() < 0.25 * (erf - ref).abs().max())
        except (AttributeError, NotImplementedError, RuntimeError) as exc:   # an op this build lacks
            logger.info("cuBLASLt's bias+GELU epilogue unavailable on %s %s (%s): plain linear + GELU",
                        device, dtype, exc)
            _EPILOGUE_OK[key] = False
    return _EPILOGUE_OK[key]


def _attend_decode(q, kv, Lb: int, bias, scale: float, impl: str, pos=None, key_start=None):
    """One query token per row against the first Lb cached keys.

    q [B, Hkv, G, D] (G query heads share a K/V head), kv [B, Hkv, L, 2, D] (K at 0, V at 1),
    bias [B, Hkv, G, Lb] additive (padding, future keys, ALiBi). Returns [B, Hkv*G*D].
    impl "sdpa": one fused kernel; "bmm": baddbmm + fp32 softmax + bmm, HF's eager order;
    "triton": flash-decoding over slots 0..pos read on the device, bias = the raw per-key
    bias [B, Hb, L] (no per-step mask, no length buckets), key_start [B] int32 each row's
    first visible slot (blocks of padding before it are not read).
    """
    if impl == "triton":
        return kernels.decode_attention(q, kv, bias, pos, scale, key_start=key_start)
    B, Hkv, G, D = q.shape
    k = kv[:, :, :Lb, 0]
    v = kv[:, :, :Lb, 1]
    if impl == "bmm":
        q3 = q.reshape(B * Hkv, G, D)
        scores = torch.baddbmm(bias.reshape(B * Hkv, G, Lb), q3,
                               k.reshape(B * Hkv, Lb, D).transpose(1, 2), alpha=scale)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, v.reshape(B * Hkv, Lb, D)).reshape(B, Hkv * G * D)
    if q.is_cuda and DECODE_SDPA_BACKENDS is not None:
        with sdpa_kernel(DECODE_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(B, Hkv * G * D)


def _attend_prefill(q, k, v, bias, scale: float, impl: str):
    """Prompt attention. q [B, H, P, D], k/v [B, Hkv, P, D], bias [B, Hb, P, P] (Hb 1 or H).
    Returns [B, P, H*D]."""
    B, H, P, D = q.shape
    Hkv = k.shape[1]
    if impl == "bmm" and Hkv == H:
        bias = bias.expand(B, H, P, P)
        scores = torch.baddbmm(bias.reshape(B * H, P, P), q.reshape(B * H, P, D),
                               k.reshape(B * H, P, D).transpose(1, 2), alpha=scale)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs, v.reshape(B * H, P, D)).view(B, H, P, D)
    else:
        kw = {"enable_gqa": True} if Hkv != H else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, **kw)
    return out.transpose(1, 2).reshape(B, P, H * D)


def _prefill_bias(key_bias, P: int):
    """[B, Hb, P] per-key bias -> [B, Hb, P, P] with the causal restriction added."""
    idx = torch.arange(P, device=key_bias.device)
    causal = idx[None, :] <= idx[:, None]
    return torch.where(causal, key_bias[:, :, None, :P], _min_value(key_bias.dtype))


# --------------------------------------------------------------------------- blocks

@dataclass(frozen=True)
class TPShard:
    """What a decode block needs to run as one rank of a tensor-parallel group over the
    rank's slice of the replica (rollout.tensor_parallel.TPReplica: whole heads and MLP
    channels of the column-parallel linears, the matching input columns of the
    row-parallel ones, a vocab slice [vocab_lo, vocab_hi) of embedding and head).
    `group` sums (`all_reduce_`) and gathers (`all_gather`) within the group."""
    group: Any
    vocab: int
    vocab_lo: int
    vocab_hi: int
    vocab_parallel: bool = True

    def pad_vocab_slice(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's vocab-slice logits padded to ceil(V / size) columns: every rank's
        slice then has one shape for the group's gather (the last rank's may be short)."""
        chunk = -(-self.vocab // self.group.size)
        return F.pad(local, (0, chunk - local.shape[-1])) if local.shape[-1] < chunk else local


class _DecodeBlock:
    """Per-family decode math over the replica's own tensors (held as references).

    Subclasses set n_layers, n_heads, n_kv_heads, head_dim, bias_heads (1, or n_heads for
    per-head ALiBi), vocab and implement bind / key_bias / prompt_positions / prefill /
    decode. `bind()` re-resolves every tensor from the model (cheap attribute walks) and
    (re)allocates derived buffers only when their shapes change; `rebuild()` refills them.
    """

    def __init__(self, model, *, numerics: str, fuse_qkv: bool, on_cuda: bool,
                 attn_impl: Optional[str] = None, use_triton: bool = False,
                 kernel_options: Optional[kernels.KernelOptions] = None, tp: Optional["TPShard"] = None):
        self.model = model
        self.tp = tp
        self.kopts = kernel_options or kernels.options()
        # residual add + next norm: one Triton kernel per norm in the decode step
        self.use_triton = use_triton
        self.add_norm = kernels.add_norm if use_triton else add_norm_ref
        self.config = model.config
        self.fam = family_of(model)
        self.numerics = numerics
        # the decode step's linears: cuBLAS, or per shape the faster of cuBLAS and Triton
        # kernels (KernelOptions.decode_linear); 2-D inputs only, so the prompt's 3-D ones
        # and numerics "hf" keep F.linear
        mode = self.kopts.decode_linear if (use_triton and numerics == "fast") else False
        self.lin = (kernels.tuned_linear if mode == "auto" else
                    kernels.linear if mode is True else _lin)
        self.fuse_qkv = fuse_qkv
        self.on_cuda = on_cuda
        self._derived: dict[str, torch.Tensor] = {}
        self.bind()
        self.attn_impl = attn_impl or self.default_attention(self.head_dim, numerics, use_triton,
                                                             self.kopts.attn_pad_head_dim)

    @classmethod
    def unsupported_reason(cls, model, config, max_total_len) -> Optional[str]:
        return None

    # tensor parallelism: the same maths on this rank's slice ----------------------
    def local_heads(self, n: int) -> int:
        """Heads of this rank: all of them, or 1/size of them in a tensor-parallel group."""
        return n if self.tp is None else n // self.tp.group.size

    def embed_tokens(self, ids):
        """Token embeddings; in a TP group a vocab-parallel lookup (own rows, others zero)
        summed over the group."""
        tp = self.tp
        if tp is None or not tp.vocab_parallel:
            return F.embedding(ids, self.embed)
        local = ids - tp.vocab_lo
        inside = (local >= 0) & (local < tp.vocab_hi - tp.vocab_lo)
        if tp.vocab_hi > tp.vocab_lo:
            x = F.embedding(local.clamp(0, tp.vocab_hi - tp.vocab_lo - 1), self.embed)
        else:
            x = ids.new_zeros(ids.shape + (self.embed.shape[1],), dtype=self.dtype)
        return tp.group.all_reduce_(x.masked_fill(~inside[..., None], 0))

    def head_logits(self, h, lin=None):
        """Logits over the whole vocabulary; in a TP group every rank computes its vocab
        slice and the slices are all-gathered."""
        tp = self.tp
        if tp is None:
            return (lin or self.lin)(h, self.head)
        local = F.linear(h, self.head)
        if not tp.vocab_parallel or tp.group.size == 1:
            return local
        local = tp.pad_vocab_slice(local)
        return torch.cat(tp.group.all_gather(local.contiguous()), dim=-1)[..., :tp.vocab]

    def tp_sum(self, partial):
        """A row-parallel product summed over the TP group; 16-bit partials are summed in
        fp32 and rounded once, closer to one full GEMM's single rounding."""
        group = self.tp.group
        if group.size == 1 or partial.element_size() >= 4:
            return group.all_reduce_(partial)
        return group.all_reduce_(partial.float()).to(partial.dtype)

    def row_linear(self, a, lin):
        """An output projection (attention out, MLP down): under TP this rank's input
        columns, summed over the group, the (replicated) bias added once."""
        if self.tp is None:
            return self.lin(a, *lin)
        y = self.tp_sum(self.lin(a, lin[0]))
        return y if lin[1] is None else y + lin[1]

    def step_bias(self, key_bias, arange, pos, Lb: int):
        """A decode step's attention bias from the per-key bias [B, Hb, L]: keys after the
        fed token's slot `pos` masked, [B, Hkv, G, Lb]; the Triton kernel takes the raw
        per-key bias and reads `pos` itself."""
        if self.attn_impl == "triton":
            return key_bias
        B, G = key_bias.shape[0], self.n_heads // self.n_kv_heads
        kb = key_bias[:, :, None, :Lb].expand(B, self.n_kv_heads, G, Lb)
        return torch.where(arange[:Lb] <= pos, kb, _min_value(self.dtype))

    @staticmethod
    def default_attention(head_dim: int, numerics: str, use_triton: bool, pad_head_dim: bool = True) -> str:
        """Decode attention measured fastest among those whose seeded sampling reproduces
        through captured graphs: the Triton kernel up to head_dim 128 (from head_dim 128 its
        tensor-core variant, KernelOptions.attn_dot); baddbmm otherwise and for
        numerics="hf" (HF's exact op order). cuDNN SDPA did not reproduce seeded sampling
        through graphs. Measurements: docs/DECODE.md, section 4."""
        # the Triton kernel spans head_dim in one power-of-two block (bloom-3b and pythia-2.8b
        # have 80, gpt-neox-20b 96: padded to 128 unless KernelOptions.attn_pad_head_dim is off)
        pow2 = head_dim & (head_dim - 1) == 0 or pad_head_dim
        if numerics == "fast" and use_triton and head_dim <= 128 and pow2:
            return "triton"
        return "bmm"

    # weights -------------------------------------------------------------------
    def part(self, path: str):
        return resolve(self.model, path)

    def bind(self) -> None:
        raise NotImplementedError

    def tensors(self) -> list:
        """Every replica tensor the block reads (for address checks)."""
        raise NotImplementedError

    def pointers(self) -> list:
        return [t.data_ptr() for t in self.tensors()]

    def fused_qkv(self, i: int, lay: dict) -> tuple:
        """Layer i's (weight, bias) of Q, K and V concatenated into derived buffers."""
        w = self.derived(f"qkv_w{i}", [lay["q"][0], lay["k"][0], lay["v"][0]])
        b = None if lay["q"][1] is None else self.derived(f"qkv_b{i}", [lay["q"][1], lay["k"][1], lay["v"][1]])
        return w, b

    def derived(self, name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """A buffer holding cat(parts, 0), allocated once per shape (fixed address)."""
        shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
        buf = self._derived.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != parts[0].dtype:
            buf = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
            self._derived[name] = buf
        return buf

    def rebuild(self) -> None:
        """Refill derived (fused) weights from the replica's current values."""

    # math ----------------------------------------------------------------------
    def key_bias(self, ext_mask):
        """[B, L] 0/1 mask over every cache slot -> [B, Hb, L] additive per-key bias."""
        neg = torch.zeros(ext_mask.shape, dtype=self.dtype, device=ext_mask.device)
        neg.masked_fill_(ext_mask == 0, _min_value(self.dtype))
        return neg[:, None, :]

    def prompt_positions(self, mask):
        """Position ids of the prompt tokens [B, P] (families without ids return None)."""
        return None

    @staticmethod
    def _ln(x, ln):
        """LayerNorm with ln = (weight, bias, eps)."""
        return F.layer_norm(x, (x.shape[-1],), ln[0], ln[1], ln[2])

    def rope_(self, x, cos, sin) -> None:
        """Rotary in place on x [B, H, J, D] (kernels.rope_ref_ says how); one Triton
        kernel where Triton is allowed."""
        (kernels.rope_ if self.use_triton else kernels.rope_ref_)(x, cos, sin)

    def norms(self, x):
        """The fused add+norm for this tensor (the Triton one only for 2-D decode tensors)."""
        return self.add_norm if x.dim() == 2 else add_norm_ref

    def lin_add_norm(self, a, lin, r, nw, nb, eps: float, rms: bool, y2=None, second=None):
        """add_norm(linear(a, *lin), r, nw, nb, eps, y2=, second=): the residual add + norm
        after a block's output projections (add_norm_ref says what y2 and second add). With
        per-shape linears ("auto") one tuned op for decode tensors, where the linear may be
        split over K into partials that the norm kernel sums."""
        if self.tp is not None:
            return self.norms(a)(self.row_linear(a, lin), r, nw, nb, eps, rms, y2, second)
        if self.lin is kernels.tuned_linear and a.dim() == 2:
            return kernels.linear_add_norm(a, lin[0], lin[1], r, nw, nb, eps, rms, y2, second)
        return self.norms(a)(self.lin(a, *lin), r, nw, nb, eps, rms, y2, second)

    @property
    def dtype(self):
        return self.embed.dtype

    @property
    def device(self):
        return self.embed.device

    def attend_step(self, q, new_kv, kv, Lb: int, bias, pos, key_start):
        """One decode step's attention for one layer: q [B, Hkv, G, D], this step's K/V
        new_kv [B, Hkv, 2, D] (any strides, contiguous last dim) written into cache slot pos,
        then q against the cache (see _attend_decode). The Triton kernel writes the K/V
        itself where KernelOptions.fuse_kv_write."""
        if self.attn_impl == "triton" and self.kopts.fuse_kv_write:
            return kernels.decode_attention(q, kv, bias, pos, self.scale, new_kv=new_kv,
                                                  key_start=key_start)
        kernels.write_kv_ref(kv, new_kv, pos)
        return _attend_decode(q, kv, Lb, bias, self.scale, self.attn_impl, pos, key_start)


@register_block("bloom")
class _BloomBlock(_DecodeBlock):
    """Bloom: fused interleaved QKV ([H, 3, D] per row), ALiBi, tanh-GELU MLP."""

    @classmethod
    def unsupported_reason(cls, model, config, max_total_len):
        if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
            return "bloom slow_but_exact with pretraining_tp > 1"
        if config.hidden_size % config.n_head:
            return "hidden_size not divisible by n_head"
        return None

    def bind(self):
        c, fam = self.config, self.fam
        self.n_heads = self.n_kv_heads = self.bias_heads = self.local_heads(c.n_head)
        self.head_dim = c.hidden_size // c.n_head
        self.hidden = c.hidden_size
        self.post_ln_residual = bool(c.apply_residual_connection_post_layernorm)
        self.embed = self.part(fam.embed_tokens).weight
        emb_ln = self.part(fam.extra_pre[0])
        self.emb_ln = (emb_ln.weight, emb_ln.bias, emb_ln.eps)
        fin = self.part(fam.final_norm)
        self.ln_f = (fin.weight, fin.bias, fin.eps)
        self.head = self.part(fam.lm_head).weight
        self.layers = []
        for blk in self.part(fam.blocks):
            at, mlp = blk.self_attention, blk.mlp
            self.layers.append(dict(
                ln1=(blk.input_layernorm.weight, blk.input_layernorm.bias, blk.input_layernorm.eps),
                qkv=(at.query_key_value.weight, at.query_key_value.bias),
                dense=(at.dense.weight, at.dense.bias),
                ln2=(blk.post_attention_layernorm.weight, blk.post_attention_layernorm.bias,
                     blk.post_attention_layernorm.eps),
                fc1=(mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias),
                fc2=(mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias)))
        self.n_layers = len(self.layers)
        self.vocab = self.head.shape[0]
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # ALiBi slopes of this rank's heads (a TP rank holds a contiguous run of them)
        h0 = 0 if self.tp is None else self.tp.group.rank * self.n_heads
        self.slopes = _alibi_slopes(c.n_head, self.embed.device)[h0:h0 + self.n_heads]
        self.gelu_epilogue = self.on_cuda and _gelu_epilogue_is_tanh(self.embed.device, self.dtype)

    def tensors(self):
        out = [self.embed, *self.emb_ln[:2], *self.ln_f[:2], self.head]
        for lay in self.layers:
            for v in lay.values():
                out += [t for t in v if isinstance(t, torch.Tensor)]
        return out

    def key_bias(self, ext_mask):
        # HF: alibi = slope * ((cumsum(mask) - 1) * mask) in fp32, cast to the model dtype.
        kpos = (ext_mask.cumsum(-1) - 1) * ext_mask
        alibi = (self.slopes[None, :, None] * kpos[:, None, :].float()).to(self.dtype)
        return alibi.masked_fill((ext_mask == 0)[:, None, :], _min_value(self.dtype))

    def _mlp_up(self, h, fc1, exact: bool):
        if exact:                  # HF's bloom_gelu_forward, each intermediate rounded as HF's
            y = _lin(h, *fc1)
            if self.use_triton and y.dim() == 2:
                return kernels.hf_gelu(y)
            return kernels.hf_gelu_ref(y)
        if self.lin is kernels.tuned_linear and h.dim() == 2:
            return kernels.tuned_linear(h, *fc1, gelu=True,
                                              epilogue=self.gelu_epilogue and h.shape[0] > 1)
        if self.lin is kernels.linear and h.dim() == 2:
            return kernels.linear(h, *fc1, gelu=True)
        if self.gelu_epilogue and h.dim() == 2 and h.shape[0] > 1:
            # cuBLASLt bias+GELU(tanh) epilogue: one kernel instead of two
            return torch._addmm_activation(fc1[1], h, fc1[0].t(), use_gelu=True)
        return F.gelu(_lin(h, *fc1), approximate="tanh")

    def _body(self, x, attend, exact: bool):
        """Embedding-norm output -> final-norm output; attend(layer, h) -> context [.., H*D].
        Each residual add is fused with the norm that follows it."""
        last = len(self.layers) - 1
        h = self._ln(x, self.layers[0]["ln1"])
        for li, lay in enumerate(self.layers):
            res = h if self.post_ln_residual else x
            x, h = self.lin_add_norm(attend(li, h), lay["dense"], res, *lay["ln2"], rms=False)
            res = h if self.post_ln_residual else x
            nxt = self.ln_f if li == last else self.layers[li + 1]["ln1"]
            x, h = self.lin_add_norm(self._mlp_up(h, lay["fc1"], exact), lay["fc2"], res, *nxt, rms=False)
        return h

    def prefill(self, ids, mask, pos_ids, kv, key_bias, hidden: bool = False):
        B, P = ids.shape
        H, D = self.n_heads, self.head_dim
        bias = _prefill_bias(key_bias, P)
        # The prompt runs once per generate: HF's eager op order (baddbmm attention, GELU
        # rounded op by op) where its fp32 scores fit in 1 GiB, so that the first token's
        # logits match HF's bit for bit; SDPA beyond that.
        impl = "bmm" if B * H * P * P * 4 <= 2 ** 30 else "sdpa"

        def attend(li, h):
            qkv = _lin(h, *self.layers[li]["qkv"]).view(B, P, H, 3, D)
            kv[li, :, :, :P].copy_(qkv[:, :, :, 1:3].transpose(1, 2))
            q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
            return _attend_prefill(q, k, v, bias, self.scale, impl)
        h = self._body(self._ln(self.embed_tokens(ids), self.emb_ln), attend, exact=True)
        return h if hidden else self.head_logits(h[:, -1], _lin)

    def decode(self, tok, row_pos, pos, kv, bias, Lb, key_start=None):
        B = tok.shape[0]
        H, D = self.n_heads, self.head_dim

        def attend(li, h):
            qkv = self.lin(h, *self.layers[li]["qkv"]).view(B, H, 3, D)
            return self.attend_step(qkv[:, :, 0:1], qkv[:, :, 1:3], kv[li], Lb, bias, pos, key_start)
        h = self._body(self._ln(self.embed_tokens(tok), self.emb_ln), attend,
                       exact=self.numerics == "hf")
        return self.head_logits(h)


@register_block("opt")
class _OPTBlock(_DecodeBlock):
    """OPT: learned positions (offset 2, from the mask cumsum), pre- or post-LN layers,
    optional project_in/out; Q/K/V fused into one derived weight when fuse_qkv."""

    @classmethod
    def unsupported_reason(cls, model, config, max_total_len):
        # a learned position table: prompt + answer must fit it (past it HF's lookup fails too)
        n_pos = getattr(config, "max_position_embeddings", None)
        if max_total_len is not None and n_pos is not None and max_total_len > n_pos:
            return f"prompt + answer ({max_total_len}) longer than the position table ({n_pos})"
        return None

    def bind(self):
        c, fam = self.config, self.fam
        self.n_heads = self.n_kv_heads = self.local_heads(c.num_attention_heads)
        self.bias_heads = 1
        self.hidden = c.hidden_size
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.pre_ln = bool(c.do_layer_norm_before)
        self.embed = self.part(fam.embed_tokens).weight
        pos_mod = self.part(fam.extra_pre[0])
        self.pos_table, self.pos_offset = pos_mod.weight, getattr(pos_mod, "offset", 2)
        p_in, p_out = self.part(fam.extra_pre[1]), self.part(fam.extra_post[0])
        self.project_in = None if p_in is None else p_in.weight
        self.project_out = None if p_out is None else p_out.weight
        fin = self.part(fam.final_norm)
        self.ln_f = None if fin is None else (fin.weight, fin.bias, fin.eps)
        self.head = self.part(fam.lm_head).weight
        self.layers = []
        for i, blk in enumerate(self.part(fam.blocks)):
            at = blk.self_attn
            lay = dict(
                q=(at.q_proj.weight, at.q_proj.bias), k=(at.k_proj.weight, at.k_proj.bias),
                v=(at.v_proj.weight, at.v_proj.bias), o=(at.out_proj.weight, at.out_proj.bias),
                ln1=(blk.self_attn_layer_norm.weight, blk.self_attn_layer_norm.bias,
                     blk.self_attn_layer_norm.eps),
                ln2=(blk.final_layer_norm.weight, blk.final_layer_norm.bias, blk.final_layer_norm.eps),
                fc1=(blk.fc1.weight, blk.fc1.bias), fc2=(blk.fc2.weight, blk.fc2.bias),
                act=blk.activation_fn)
            if self.fuse_qkv:
                lay["qkv"] = self.fused_qkv(i, lay)
            self.layers.append(lay)
        self.n_layers = len(self.layers)
        self.vocab = self.head.shape[0]
        self.scale = self.head_dim ** -0.5

    @torch.no_grad()
    def rebuild(self):
        if not self.fuse_qkv:
            return
        for lay in self.layers:
            torch.cat([lay["q"][0], lay["k"][0], lay["v"][0]], 0, out=lay["qkv"][0])
            if lay["qkv"][1] is not None:
                torch.cat([lay["q"][1], lay["k"][1], lay["v"][1]], 0, out=lay["qkv"][1])

    def tensors(self):
        out = [self.embed, self.pos_table, self.head]
        out += [t for t in (self.project_in, self.project_out) if t is not None]
        out += [t for t in (self.ln_f or ())[:2] if isinstance(t, torch.Tensor)]
        for lay in self.layers:
            for key in ("q", "k", "v", "o", "ln1", "ln2", "fc1", "fc2"):
                out += [t for t in lay[key] if isinstance(t, torch.Tensor)]
        return out

    def prompt_positions(self, mask):
        # OPT's learned positions as HF's OPT computes them (pads -1, before its offset of 2)
        return (mask.cumsum(-1) * mask - 1).long()

    def _embed(self, ids, pos):
        x = self.embed_tokens(ids)
        if self.project_in is not None:
            x = _lin(x, self.project_in)
        return x + F.embedding(pos + self.pos_offset, self.pos_table)

    def _qkv(self, h, lay):
        """[..., 3, H, D] projections (fused or three GEMMs)."""
        shape = h.shape[:-1] + (3, self.n_heads, self.head_dim)
        if self.fuse_qkv:
            return self.lin(h, *lay["qkv"]).view(shape)
        return torch.stack([self.lin(h, *lay[n]) for n in "qkv"], dim=-2).view(shape)

    def _body(self, x, attend):
        """Embeddings -> last hidden state before project_out; attend(layer, h) -> context.
        Residual adds are fused with the norm that follows them (pre- or post-LN)."""
        last = len(self.layers) - 1
        up = lambda h, lay: lay["act"](self.lin(h, *lay["fc1"]))  # noqa: E731
        if not self.pre_ln:
            for li, lay in enumerate(self.layers):
                _, x = self.lin_add_norm(attend(li, x), lay["o"], x, *lay["ln1"], rms=False)
                _, x = self.lin_add_norm(up(x, lay), lay["fc2"], x, *lay["ln2"], rms=False)
            return x if self.ln_f is None else self._ln(x, self.ln_f)
        h = self._ln(x, self.layers[0]["ln1"])
        for li, lay in enumerate(self.layers):
            x, h = self.lin_add_norm(attend(li, h), lay["o"], x, *lay["ln2"], rms=False)
            nxt = self.ln_f if li == last else self.layers[li + 1]["ln1"]
            if nxt is None:
                h = x + self.row_linear(up(h, lay), lay["fc2"])
            else:
                x, h = self.lin_add_norm(up(h, lay), lay["fc2"], x, *nxt, rms=False)
        return h

    def _project_out(self, h, lin=_lin):
        return h if self.project_out is None else lin(h, self.project_out)

    def _logits(self, h, lin=_lin):
        return self.head_logits(self._project_out(h, lin), lin)

    def prefill(self, ids, mask, pos_ids, kv, key_bias, hidden: bool = False):
        B, P = ids.shape
        bias = _prefill_bias(key_bias, P)

        def attend(li, h):
            qkv = self._qkv(h, self.layers[li])                  # [B, P, 3, H, D]
            kv[li, :, :, :P].copy_(qkv[:, :, 1:3].permute(0, 3, 1, 2, 4))
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            return _attend_prefill(q, k, v, bias, self.scale, self.attn_impl)
        h = self._body(self._embed(ids, pos_ids), attend)
        return self._project_out(h) if hidden else self._logits(h[:, -1])

    def decode(self, tok, row_pos, pos, kv, bias, Lb, key_start=None):
        def attend(li, h):
            qkv = self._qkv(h, self.layers[li])                  # [B, 3, H, D]
            return self.attend_step(qkv[:, 0].unsqueeze(2), qkv[:, 1:3].transpose(1, 2), kv[li], Lb,
                                    bias, pos, key_start)
        return self._logits(self._body(self._embed(tok, row_pos), attend), self.lin)


def attention_window(config) -> Optional[int]:
    """The attention window a config imposes on any layer (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and all(t == "full_attention" for t in layer_types):
        return None
    return int(window)


@register_block("llama")
class _LlamaBlock(_DecodeBlock):
    """LLaMA / Mistral / Qwen2: RMSNorm, rotary positions from the mask cumsum as HF generate
    builds them, grouped-query attention, gated MLP; Q/K/V fused when fuse_qkv."""

    STATIC_ROPE = ("default", "linear", "llama3", "yarn")

    @classmethod
    def rotary_reason(cls, model) -> Optional[str]:
        """Why the model's rotary embedding cannot be tabled once per position (None: it can)."""
        rotary = resolve(model, cls._rotary_path(model))
        if rotary is None or not hasattr(rotary, "inv_freq"):
            return "no rotary embedding module with inv_freq"
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in cls.STATIC_ROPE:
            return f"rope type {rope_type!r} changes with sequence length"
        return None

    @classmethod
    def unsupported_reason(cls, model, config, max_total_len):
        reason = cls.rotary_reason(model)
        if reason is not None:
            return reason
        window = attention_window(config)
        if window is not None and (max_total_len is None or window < max_total_len):
            return (f"sliding window {window} shorter than prompt + answer "
                    f"({max_total_len})" if max_total_len else f"sliding window {window}")
        return None

    @staticmethod
    def _rotary_path(model) -> str:
        return family_of(model).base_model + ".rotary_emb"

    def bind(self):
        c, fam = self.config, self.fam
        self.n_heads = self.local_heads(c.num_attention_heads)
        self.n_kv_heads = self.local_heads(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        self.bias_heads = 1
        blocks = self.part(fam.blocks)
        self.head_dim = blocks[0].self_attn.q_proj.weight.shape[0] // self.n_heads
        self.embed = self.part(fam.embed_tokens).weight
        fin = self.part(fam.final_norm)
        self.ln_f = (fin.weight, fin.variance_epsilon)
        self.head = self.part(fam.lm_head).weight
        rot = resolve(self.model, self._rotary_path(self.model))
        self.inv_freq, self.rope_scaling = rot.inv_freq, float(rot.attention_scaling)
        self.silu = getattr(c, "hidden_act", None) == "silu"       # nn.SiLU, as gated_mlp computes
        self.layers = []
        for i, blk in enumerate(blocks):
            at, mlp = blk.self_attn, blk.mlp
            lay = dict(
                q=(at.q_proj.weight, at.q_proj.bias), k=(at.k_proj.weight, at.k_proj.bias),
                v=(at.v_proj.weight, at.v_proj.bias), o=(at.o_proj.weight, at.o_proj.bias),
                ln1=(blk.input_layernorm.weight, blk.input_layernorm.variance_epsilon),
                ln2=(blk.post_attention_layernorm.weight, blk.post_attention_layernorm.variance_epsilon),
                gate=(mlp.gate_proj.weight, mlp.gate_proj.bias), up=(mlp.up_proj.weight, mlp.up_proj.bias),
                down=(mlp.down_proj.weight, mlp.down_proj.bias), act=mlp.act_fn)
            if self.fuse_qkv:
                lay["qkv"] = self.fused_qkv(i, lay)
            self.layers.append(lay)
        self.n_layers = len(self.layers)
        self.vocab = self.head.shape[0]
        self.scale = self.head_dim ** -0.5

    rebuild = _OPTBlock.rebuild

    def tensors(self):
        out = [self.embed, self.ln_f[0], self.head, self.inv_freq]
        for lay in self.layers:
            for key in ("q", "k", "v", "o", "ln1", "ln2", "gate", "up", "down"):
                out += [t for t in lay[key] if isinstance(t, torch.Tensor)]
        return out

    def prompt_positions(self, mask):
        return positions_from_mask(mask)

    @staticmethod
    def _rms(x, ln):
        # HF: normalise in fp32, round to the model dtype, then scale by the weight
        return F.rms_norm(x, (x.shape[-1],), None, ln[1]) * ln[0]

    def _rope_tables(self, pos):
        """cos and sign-folded sin for positions `pos` [...], each [..., D], model dtype."""
        freqs = pos[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == swap_halves(x) * [-sin_lo, sin_hi] exactly (negation is exact)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos, sin

    def _qkv(self, h, lay):
        """[..., Hq + 2*Hkv, D] projections."""
        shape = h.shape[:-1] + (self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        if self.fuse_qkv:
            return self.lin(h, *lay["qkv"]).view(shape)
        return torch.cat([self.lin(h, *lay[n]) for n in "qkv"], dim=-1).view(shape)

    def _mlp_inner(self, h, lay):
        if self.silu and self.kopts.fuse_gated and self.lin is kernels.tuned_linear and h.dim() == 2:
            return kernels.gated_mlp(h, *lay["gate"], *lay["up"])    # one kernel where faster
        return lay["act"](self.lin(h, *lay["gate"])) * self.lin(h, *lay["up"])

    def _body(self, x, attend):
        """Embeddings -> final-norm output; attend(layer, h) -> context. Residual adds are
        fused with the RMSNorm that follows them."""
        last = len(self.layers) - 1
        h = self._rms(x, self.layers[0]["ln1"])
        for li, lay in enumerate(self.layers):
            w, eps = lay["ln2"]
            x, h = self.lin_add_norm(attend(li, h), lay["o"], x, w, None, eps, rms=True)
            w, eps = self.ln_f if li == last else self.layers[li + 1]["ln1"]
            x, h = self.lin_add_norm(self._mlp_inner(h, lay), lay["down"], x, w, None, eps, rms=True)
        return h

    def prefill(self, ids, mask, pos_ids, kv, key_bias, hidden: bool = False):
        B, P = ids.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        bias = _prefill_bias(key_bias, P)
        cos, sin = self._rope_tables(pos_ids)                  # [B, P, D]

        def attend(li, h):
            qkv = self._qkv(h, self.layers[li])                # [B, P, Hq+2Hkv, D], fresh
            kernels.rope_ref_(qkv[:, :, :Hq + Hkv], cos, sin)     # q and k rows in place
            k, v = qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
            kv[li, :, :, :P].copy_(torch.stack((k, v), dim=3).transpose(1, 2))
            return _attend_prefill(qkv[:, :, :Hq].transpose(1, 2), k.transpose(1, 2),
                                   v.transpose(1, 2), bias, self.scale, self.attn_impl)
        h = self._body(self.embed_tokens(ids), attend)
        return h if hidden else self.head_logits(h[:, -1], _lin)

    def decode(self, tok, row_pos, pos, kv, bias, Lb, key_start=None):
        B = tok.shape[0]
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        cos, sin = self._rope_tables(row_pos)                  # [B, D]

        def attend(li, h):
            qkv = self._qkv(h, self.layers[li])                # [B, Hq+2Hkv, D], fresh
            self.rope_(qkv[:, :Hq + Hkv, None], cos, sin)      # q and k rows in place
            q = qkv[:, :Hq].view(B, Hkv, Hq // Hkv, D)
            new_kv = qkv[:, Hq:].view(B, 2, Hkv, D).transpose(1, 2)  # [B, Hkv, 2, D]
            return self.attend_step(q, new_kv, kv[li], Lb, bias, pos, key_start)
        return self.head_logits(self._body(self.embed_tokens(tok), attend))


@register_block("gpt2")
class _GPT2Block(_OPTBlock):
    """GPT-2: OPT's decode math (learned positions, pre-LN, a [3, H, D] QKV) over Conv1D
    weights ([in, out], read through transposed views: cuBLAS, no copies), positions from
    the mask cumsum as HF generate builds them, no offset."""

    @classmethod
    def unsupported_reason(cls, model, config, max_total_len):
        if getattr(config, "add_cross_attention", False):
            return "cross-attention layers"
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            return "attention scaled per layer (scale_attn_by_inverse_layer_idx)"
        return super().unsupported_reason(model, config, max_total_len)

    def bind(self):
        c, fam = self.config, self.fam
        self.n_heads = self.n_kv_heads = c.num_attention_heads
        self.bias_heads = 1
        self.hidden = c.hidden_size
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.pre_ln = True
        self.fuse_qkv = True                    # c_attn is one Conv1D already: nothing derived
        self.embed = self.part(fam.embed_tokens).weight
        self.pos_table, self.pos_offset = self.part(fam.extra_pre[0]).weight, 0
        self.project_in = self.project_out = None
        fin = self.part(fam.final_norm)
        self.ln_f = (fin.weight, fin.bias, fin.eps)
        self.head = self.part(fam.lm_head).weight
        self.layers = []
        for blk in self.part(fam.blocks):
            at, mlp = blk.attn, blk.mlp
            conv = lambda m: (m.weight.t(), m.bias)     # noqa: E731  y = x @ W + b
            self.layers.append(dict(
                qkv=conv(at.c_attn), o=conv(at.c_proj), fc1=conv(mlp.c_fc), fc2=conv(mlp.c_proj),
                ln1=(blk.ln_1.weight, blk.ln_1.bias, blk.ln_1.eps),
                ln2=(blk.ln_2.weight, blk.ln_2.bias, blk.ln_2.eps), act=self._act(mlp.act)))
        self.n_layers = len(self.layers)
        self.vocab = self.head.shape[0]
        self.scale = self.head_dim ** -0.5 if c.scale_attn_weights else 1.0

    def _act(self, hf_act):
        """GPT-2's gelu_new (HF's eight eager ops, each rounded) as one Triton kernel on
        decode tensors; any other activation, and prefill, through HF's module."""
        if self.config.activation_function != "gelu_new" or not self.use_triton:
            return hf_act
        return lambda y: kernels.new_gelu(y) if y.dim() == 2 else hf_act(y)

    def rebuild(self):
        pass

    def tensors(self):
        out = [self.embed, self.pos_table, self.head, *self.ln_f[:2]]
        for lay in self.layers:
            for key in ("qkv", "o", "ln1", "ln2", "fc1", "fc2"):
                out += [t for t in lay[key] if isinstance(t, torch.Tensor)]
        return out

    prompt_positions = _LlamaBlock.prompt_positions


@register_block("gpt_neox")
class _GPTNeoXBlock(_DecodeBlock):
    """GPT-NeoX (Pythia): fused QKV with each head's [q, k, v] rows together, rotary
    positions on the first rotary_ndims dims of each head (partial rotary), LayerNorm, and
    either the parallel residual x + attn(ln1(x)) + mlp(ln2(x)) or the serial one."""

    @classmethod
    def unsupported_reason(cls, model, config, max_total_len):
        reason = _LlamaBlock.rotary_reason(model)
        if reason is not None:
            return reason
        if config.hidden_size % config.num_attention_heads:
            return "hidden_size not divisible by num_attention_heads"
        return None

    def bind(self):
        c, fam = self.config, self.fam
        self.n_heads = self.n_kv_heads = self.local_heads(c.num_attention_heads)
        self.bias_heads = 1
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.parallel = bool(c.use_parallel_residual)
        # nn.GELU (exact, erf) can run in the decode linear's epilogue; other activations
        # (gelu_new's op-by-op tanh and the rest) stay HF's module after the linear
        self.erf_gelu = getattr(c, "hidden_act", None) == "gelu"
        blocks = self.part(fam.blocks)
        self.embed = self.part(fam.embed_tokens).weight
        fin = self.part(fam.final_norm)
        self.ln_f = (fin.weight, fin.bias, fin.eps)
        self.head = self.part(fam.lm_head).weight
        rot = resolve(self.model, _LlamaBlock._rotary_path(self.model))
        self.inv_freq = rot.inv_freq
        self.rope_scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.layers = []
        for blk in blocks:
            at, mlp = blk.attention, blk.mlp
            ln1, ln2 = blk.input_layernorm, blk.post_attention_layernorm
            self.layers.append(dict(
                ln1=(ln1.weight, ln1.bias, ln1.eps), ln2=(ln2.weight, ln2.bias, ln2.eps),
                qkv=(at.query_key_value.weight, at.query_key_value.bias),
                dense=(at.dense.weight, at.dense.bias),
                fc1=(mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias),
                fc2=(mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias), act=mlp.act))
        self.n_layers = len(self.layers)
        self.vocab = self.head.shape[0]
        self.scale = self.head_dim ** -0.5

    def tensors(self):
        out = [self.embed, *self.ln_f[:2], self.head, self.inv_freq]
        for lay in self.layers:
            for key in ("ln1", "ln2", "qkv", "dense", "fc1", "fc2"):
                out += [t for t in lay[key] if isinstance(t, torch.Tensor)]
        return out

    prompt_positions = _LlamaBlock.prompt_positions
    _rope_tables = _LlamaBlock._rope_tables

    def _mlp(self, h, lay):
        if self.erf_gelu and h.dim() == 2 and self.lin in (kernels.tuned_linear, kernels.linear):
            return self.lin(h, *lay["fc1"], gelu="erf")
        return lay["act"](self.lin(h, *lay["fc1"]))

    def _body(self, x, attend):
        """Embeddings -> final-norm output; attend(layer, h) -> context [.., H*D]. Residual
        adds are fused with the norm that follows them."""
        last = len(self.layers) - 1
        h = self._ln(x, self.layers[0]["ln1"])
        h2 = self._ln(x, self.layers[0]["ln2"]) if self.parallel else None
        for li, lay in enumerate(self.layers):
            nxt = self.ln_f if li == last else self.layers[li + 1]["ln1"]
            if self.parallel:
                # HF: (mlp(ln2(x)) + attn(ln1(x))) + x, in that order. One kernel adds both
                # and normalises x for the next layer's attention and MLP (ln1 and ln2)
                a = self.row_linear(attend(li, h), lay["dense"])
                second = None if li == last else self.layers[li + 1]["ln2"]
                out = self.lin_add_norm(self._mlp(h2, lay), lay["fc2"], x, *nxt, rms=False, y2=a,
                                        second=second)
                x, h, h2 = out if second is not None else (*out, None)
            else:
                x, h = self.lin_add_norm(attend(li, h), lay["dense"], x, *lay["ln2"], rms=False)
                x, h = self.lin_add_norm(self._mlp(h, lay), lay["fc2"], x, *nxt, rms=False)
        return h

    def prefill(self, ids, mask, pos_ids, kv, key_bias, hidden: bool = False):
        B, P = ids.shape
        H, D = self.n_heads, self.head_dim
        bias = _prefill_bias(key_bias, P)
        cos, sin = self._rope_tables(pos_ids)                  # [B, P, rot_dims]

        def attend(li, h):
            qkv = _lin(h, *self.layers[li]["qkv"]).view(B, P, H, 3, D)
            kernels.rope_ref_(qkv[:, :, :, 0:2], cos, sin)       # q and k rows in place
            kv[li, :, :, :P].copy_(qkv[:, :, :, 1:3].transpose(1, 2))
            q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
            return _attend_prefill(q, k, v, bias, self.scale, self.attn_impl)
        h = self._body(self.embed_tokens(ids), attend)
        return h if hidden else self.head_logits(h[:, -1], _lin)

    def decode(self, tok, row_pos, pos, kv, bias, Lb, key_start=None):
        B = tok.shape[0]
        H, D = self.n_heads, self.head_dim
        cos, sin = self._rope_tables(row_pos)                  # [B, rot_dims]

        def attend(li, h):
            qkv = self.lin(h, *self.layers[li]["qkv"]).view(B, H, 3, D)
            self.rope_(qkv[:, :, 0:2], cos, sin)               # q and k rows, in place
            return self.attend_step(qkv[:, :, 0:1], qkv[:, :, 1:3], kv[li], Lb, bias, pos, key_start)
        return self.head_logits(self._body(self.embed_tokens(tok), attend))


# --------------------------------------------------------------------------- generator

class _Clock:
    """A point in time: a CUDA event on CUDA (no sync to record), else the host clock."""

    def __init__(self, device):
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None

    def record(self):
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_to(self, later: "_Clock") -> float:
        if self.event is not None:
            later.event.synchronize()
            return self.event.elapsed_time(later.event)
        return 1e3 * (later.t - self.t)


@dataclass(frozen=True)
class _Mode:
    """What a captured step bakes in besides shapes (sampling settings, eos, pad)."""
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple
    pad: int
    min_new: bool


class _Workspace:
    """Fixed-address buffers for batch buckets up to `batch` and `length` cache slots."""

    def __init__(self, block: _DecodeBlock, batch: int, length: int, max_new: int):
        dev, dt = block.device, block.dtype
        lng = dict(dtype=torch.long, device=dev)
        self.batch, self.length = batch, length
        # K and V interleaved per slot so that one index_copy_ writes both
        self.kv = torch.zeros(block.n_layers, batch, block.n_kv_heads, length, 2, block.head_dim,
                              dtype=dt, device=dev)
        self.key_bias = torch.zeros(batch, block.bias_heads, length, dtype=dt, device=dev)
        # each row's first visible cache slot (after its left padding), set at prefill
        self.key_start = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.arange = torch.arange(length, **lng)
        self.tok = torch.zeros(batch, **lng)
        self.row_pos = torch.zeros(batch, **lng)
        self.counters = torch.zeros(2, **lng)        # [cache slot of the fed token, tokens made]
        self.pos, self.t = self.counters[0:1], self.counters[1:2]
        self.min_new = torch.zeros(1, **lng)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.out = torch.zeros(batch, max_new, **lng)
        self.graphs: dict = {}
        self.eos_tensors: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None

    def eos_tensor(self, eos: tuple):
        if eos not in self.eos_tensors:
            self.eos_tensors[eos] = torch.tensor(eos, dtype=torch.long, device=self.kv.device)
        return self.eos_tensors[eos]


class FastGenerator:
    """Generation from a persistent inference replica with a static KV cache and CUDA graphs.

    model: plain HF causal LM (bloom, opt, llama/mistral/qwen2 configs) whose tensors are
    refilled in place; call `refresh()` after each refill. `numerics`: "fast" (fused SDPA
    attention, fused GELU epilogue) or "hf" (Bloom attention and GELU in HF's eager op
    order, for closest bf16 agreement). `fuse_qkv` (None: on for CUDA) keeps a fused Q/K/V
    weight per layer for OPT/LLaMA (extra memory: one copy of those weights), rebuilt by
    `refresh()`. `attn_impl` ("sdpa" | "bmm") overrides the decode attention numerics picks.
    `use_triton` (None: on for CUDA where Triton imports) fuses residual adds with norms (and
    HF's op-by-op GELU under numerics="hf"); attn_impl="triton" is an opt-in flash-decoding
    kernel that reads the filled length on the device (one graph per batch bucket).
    `kernel_options` (kernels.KernelOptions; None: those in force when it is built,
    the defaults unless inside `kernels.use_options`) are the Triton kernels' launch
    choices, in force during this generator's calls.
    """

    def __init__(self, model, *, max_prompt_len: int, max_new_tokens: int,
                 batch_buckets=(1, 2, 4, 8, 16, 32, 64), use_cuda_graph: Optional[bool] = None,
                 numerics: str = "fast", fuse_qkv: Optional[bool] = None,
                 length_bucket: int = LENGTH_BUCKET, check_every: int = 16,
                 attn_impl: Optional[str] = None, use_triton: Optional[bool] = None,
                 kernel_options: Optional[kernels.KernelOptions] = None):
        model = unwrap_peft(model)
        reason = fast_decode_unsupported_reason(model, max_total_len=max_prompt_len + max_new_tokens)
        if reason is not None:
            raise ValueError(f"fast decode is not supported for this model: {reason}")
        if numerics not in ("fast", "hf"):
            raise ValueError(f"numerics must be 'fast' or 'hf', got {numerics!r}")
        if max_prompt_len < 1 or max_new_tokens < 1:
            raise ValueError("max_prompt_len and max_new_tokens must be >= 1")
        self.model = model
        self.kernel_options = kernel_options or kernels.options()
        dev = next(model.parameters()).device
        on_cuda = dev.type == "cuda"
        self.use_cuda_graph = on_cuda if use_cuda_graph is None else bool(use_cuda_graph)
        if self.use_cuda_graph and not on_cuda:
            raise ValueError("use_cuda_graph=True needs the model on a CUDA device")
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        self.length_bucket, self.check_every = int(length_bucket), int(check_every)
        total = self.max_prompt_len + self.max_new_tokens
        self.cache_len = -(-total // self.length_bucket) * self.length_bucket
        self.block: _DecodeBlock = build_block(
            model, numerics=numerics, fuse_qkv=on_cuda if fuse_qkv is None else bool(fuse_qkv),
            on_cuda=on_cuda, attn_impl=attn_impl,
            use_triton=(on_cuda and kernels.available()) if use_triton is None else bool(use_triton),
            kernel_options=self.kernel_options)
        self.block.rebuild()
        self._pointers = self.block.pointers()
        self._ws: Optional[_Workspace] = None
        self._gen = torch.Generator(device=dev)
        self.last_stats: dict = {}
        self.step_callback: Optional[Callable] = None   # debug: f(step, logits) after each step

    # -------------------------------------------------------------- lifecycle
    def refresh(self) -> None:
        """Call after the replica's tensors were refilled in place: rebuilds derived (fused)
        weights; if any tensor moved (reallocated, not refilled) the CUDA graphs are dropped
        and recaptured on the next generate."""
        self.block.bind()
        self.block.rebuild()
        pointers = self.block.pointers()
        if pointers != self._pointers:
            logger.info("fast decode: replica tensors moved; dropping captured CUDA graphs")
            self._pointers = pointers
            if self._ws is not None:
                self._ws.graphs.clear()

    def release(self) -> None:
        """Free the KV cache and the CUDA graphs (they are rebuilt on the next generate)."""
        self._ws = None
        if self.block.device.type == "cuda":
            torch.cuda.empty_cache()

    # -------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, input_ids, attention_mask, **kwargs) -> torch.LongTensor:
        """Left-padded prompts [B, P] -> [B, P + T] like HF generate, with this generator's
        kernel options in force (arguments: `_checked_generate`)."""
        with kernels.use_options(self.kernel_options):
            return self._checked_generate(input_ids, attention_mask, **kwargs)

    def _checked_generate(self, input_ids, attention_mask, *, max_new_tokens: Optional[int] = None,
                 min_new_tokens: int = 0, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id=None, pad_token_id: int,
                 generator: Optional[torch.Generator] = None) -> torch.LongTensor:
        """Left-padded prompts [B, P] -> [B, P + T] like HF generate (T: longest produced;
        rows that finished early are padded with pad_token_id after their eos)."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError("input_ids and attention_mask must both be [batch, prompt_len]")
        B, P = input_ids.shape
        T = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= T <= self.max_new_tokens:
            raise ValueError(f"max_new_tokens={T} outside [1, {self.max_new_tokens}] (FastGenerator's)")
        if not 1 <= P <= self.max_prompt_len:
            raise ValueError(f"prompt length {P} outside [1, max_prompt_len={self.max_prompt_len}]")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if isinstance(eos_token_id, int):
            eos = (eos_token_id,)
        else:
            eos = tuple(int(e) for e in (eos_token_id or ()))
        mode = _Mode(bool(do_sample), float(temperature), int(top_k or 0), float(top_p), eos,
                     int(pad_token_id), bool(eos) and min_new_tokens > 0)
        cap = self.batch_buckets[-1]
        if B > cap:
            parts = [self._generate(input_ids[i:i + cap], attention_mask[i:i + cap], T,
                                    min_new_tokens, mode, generator) for i in range(0, B, cap)]
            width = max(p.shape[1] for p in parts)
            return torch.cat([F.pad(p, (0, width - p.shape[1]), value=mode.pad) for p in parts])
        return self._generate(input_ids, attention_mask, T, min_new_tokens, mode, generator)

    def _bucket_len(self, n: int) -> int:
        if self.block.attn_impl == "triton":      # reads the filled length on the device
            return self.cache_len
        return min(self.cache_len, -(-n // self.length_bucket) * self.length_bucket)

    def _workspace(self, Bb: int) -> _Workspace:
        if self._ws is None or self._ws.batch < Bb:
            self._ws = None
            self._ws = _Workspace(self.block, Bb, self.cache_len, self.max_new_tokens)
        return self._ws

    def _seed(self, generator) -> None:
        """Seed the private generator the captured steps draw from."""
        if generator is not None:
            seed = torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device)
        else:
            seed = torch.randint(0, 2 ** 62, (1,))
        self._gen.manual_seed(int(seed.item()))

    def _generate(self, input_ids, attention_mask, T, min_new, mode: _Mode, generator):
        blk = self.block
        dev = blk.device
        B, P = input_ids.shape
        Bb = next(b for b in self.batch_buckets if b >= B)
        ws = self._workspace(Bb)
        lengths = sorted({self._bucket_len(p + 1) for p in range(P, P + T - 1)})
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with on_device, torch.autocast(dev.type, enabled=False):
            if self.use_cuda_graph:
                self._capture(ws, Bb, lengths, mode)
            if mode.do_sample:
                self._seed(generator)
            ev = [_Clock(dev) for _ in range(3)]
            ev[0].record()
            ids = torch.full((Bb, P), mode.pad, dtype=torch.long, device=dev)
            mask = torch.zeros((Bb, P), dtype=torch.long, device=dev)
            ids[:B] = input_ids.to(dev)
            mask[:B] = attention_mask.to(dev).long()
            mask[B:, -1] = 1                     # dummy rows: one visible key, finished at once
            ext = torch.ones((Bb, self.cache_len), dtype=torch.long, device=dev)
            ext[:, :P] = mask
            ws.key_bias[:Bb].copy_(blk.key_bias(ext))
            ws.key_start[:Bb].copy_((mask != 0).int().argmax(-1))   # first 1 (0 for no 1)
            logits = blk.prefill(ids, mask, blk.prompt_positions(mask), ws.kv[:, :Bb],
                                 ws.key_bias[:Bb, :, :P])
            ws.counters[0] = P - 1
            ws.counters[1] = 0
            ws.row_pos[:Bb].copy_(mask.sum(-1) - 1)
            ws.min_new.fill_(min_new)
            ws.finished[:Bb].copy_(torch.arange(Bb, device=dev) >= B)
            ws.out[:Bb].fill_(mode.pad)
            self._advance(ws, Bb, self._select(logits, ws, Bb, mode), mode)
            if self.step_callback is not None:
                self.step_callback(0, logits[:B])
            ev[1].record()
            check = bool(mode.eos) and min_new < T
            made = 1
            for step in range(1, T):
                Lb = self._bucket_len(P + step)          # fed token sits in slot P + step - 1
                if self.use_cuda_graph:
                    graph, logits = ws.graphs[(Bb, Lb, mode)]
                    graph.replay()
                else:
                    logits = self._step(ws, Bb, Lb, mode)
                made = step + 1
                if self.step_callback is not None:
                    self.step_callback(step, logits[:B])
                if check and made % self.check_every == 0 and bool(ws.finished[:B].all()):
                    break
            ev[2].record()
            gen = ws.out[:B, :made]
            if mode.eos:
                is_eos = (gen[..., None] == ws.eos_tensor(mode.eos)).any(-1)
                if bool(is_eos.any(-1).all()):
                    made = int(is_eos.int().argmax(-1).max()) + 1
                gen = gen[:, :made]
            result = torch.cat([input_ids.to(dev), gen], dim=1)
            self.last_stats = dict(prefill_ms=ev[0].ms_to(ev[1]), decode_ms=ev[1].ms_to(ev[2]),
                                   steps=made, batch_bucket=Bb)
        return result.to(input_ids.device)

    # -------------------------------------------------------------- step pieces
    def _step(self, ws: _Workspace, Bb: int, Lb: int, mode: _Mode):
        """One decode step on fixed buffers: feed ws.tok at slot ws.pos, sample, advance."""
        blk = self.block
        bias = blk.step_bias(ws.key_bias[:Bb], ws.arange, ws.pos, Lb)
        logits = blk.decode(ws.tok[:Bb], ws.row_pos[:Bb], ws.pos, ws.kv[:, :Bb], bias, Lb,
                            ws.key_start[:Bb])
        self._advance(ws, Bb, self._select(logits, ws, Bb, mode), mode)
        return logits

    def _select(self, logits, ws: _Workspace, Bb: int, mode: _Mode):
        """Next token per row from [Bb, V] logits, HF's processor order, on the device."""
        if mode.min_new:
            e = ws.eos_tensor(mode.eos)
            blocked = ws.t < ws.min_new
            logits.index_copy_(1, e, logits.index_select(1, e).masked_fill(blocked, float("-inf")))
        argmax = (kernels.argmax if self.block.use_triton and self.block.kopts.triton_argmax
                  else kernels.argmax_ref)
        if not mode.do_sample:
            return argmax(logits)
        x = logits.float()
        if mode.temperature != 1.0:
            x = x / mode.temperature
        idx = None
        if mode.top_k > 0:
            x, idx = torch.topk(x, min(mode.top_k, x.shape[-1]), dim=-1)   # descending
        if mode.top_p < 1.0:
            asc, order = torch.sort(x, dim=-1) if idx is None else (x.flip(-1), None)
            cum = asc.softmax(-1).cumsum(-1)
            drop = cum <= 1 - mode.top_p
            drop[..., -1] = False
            asc = asc.masked_fill(drop, float("-inf"))
            if idx is None:
                x = torch.empty_like(asc).scatter_(-1, order, asc)
            else:
                x, idx = asc, idx.flip(-1)
        probs = x.softmax(-1)
        # exponential race == categorical sample; clamp so that 0-probability tokens never win
        noise = torch.empty_like(probs).exponential_(generator=self._gen).clamp_min_(1e-20)
        choice = argmax(probs / noise)
        return choice if idx is None else idx.gather(-1, choice[:, None]).squeeze(-1)

    def _advance(self, ws: _Workspace, Bb: int, nxt, mode: _Mode) -> None:
        """Pad finished rows, record the token, update finished, move the counters."""
        if mode.eos:
            fin = ws.finished[:Bb]
            nxt = torch.where(fin, mode.pad, nxt)
            fin.logical_or_((nxt[:, None] == ws.eos_tensor(mode.eos)).any(-1))
        ws.out[:Bb].index_copy_(1, ws.t, nxt[:, None])
        ws.tok[:Bb].copy_(nxt)
        ws.counters.add_(1)
        ws.row_pos[:Bb].add_(1)

    # -------------------------------------------------------------- graphs
    def _capture(self, ws: _Workspace, Bb: int, lengths, mode: _Mode) -> None:
        """Capture the step for every needed length bucket not captured yet. Runs before
        prefill: the warm-up step writes junk only into slot 0 and the counters."""
        todo = [Lb for Lb in lengths if (Bb, Lb, mode) not in ws.graphs]
        if not todo:
            return
        if mode.eos:
            ws.eos_tensor(mode.eos)
        stream = torch.cuda.Stream()
        for Lb in todo:
            ws.counters.zero_()
            ws.tok.zero_()
            ws.row_pos.zero_()
            ws.key_start.zero_()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(ws, Bb, Lb, mode)          # warm-up: cuBLAS handles, kernel choice
            torch.cuda.current_stream().wait_stream(stream)
            ws.counters.zero_()
            graph = torch.cuda.CUDAGraph()
            if mode.do_sample:
                graph.register_generator_state(self._gen)
            with torch.cuda.graph(graph, pool=ws.pool, capture_error_mode="thread_local"):
                logits = self._step(ws, Bb, Lb, mode)
            ws.graphs[(Bb, Lb, mode)] = (graph, logits)
        ws.kv[:, :Bb, :, 0].zero_()
        torch.cuda.synchronize()
