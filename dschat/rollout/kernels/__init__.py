"""Optional Triton kernels of the fast decode step (dschat.rollout.decode), one module per
kind; every kernel has a PyTorch reference (`*_ref`) with the same rounding points, used on
CPU, without Triton, and in tests:

- options.py: KernelOptions, every launch choice in one frozen object (`options`, `use_options`);
- launch.py: Triton's import, programmatic dependent launch (Hopper), L2 prefetch;
- attention.py: flash-decoding attention over the static KV cache (`decode_attention`);
- linears.py: the decode linears (`tuned_linear`, `linear_add_norm`, `gated_mlp`, `linear`)
  raced per shape against cuBLAS, the winners kept on disk (dschat/rollout/race_cache.py);
- norm.py: residual add fused with the next LayerNorm / RMSNorm (`add_norm`);
- elementwise.py: HF-order tanh GELUs, rotary in place, argmax.

The names below are the kernels' interface; private helpers stay in their modules.
"""
from dschat.rollout.kernels.attention import decode_attention, decode_attention_ref, write_kv_ref
from dschat.rollout.kernels.elementwise import (
                                                argmax,
                                                argmax_ref,
                                                hf_gelu,
                                                hf_gelu_ref,
                                                new_gelu,
                                                new_gelu_ref,
                                                rope_,
                                                rope_ref_,
)
from dschat.rollout.kernels.launch import available
from dschat.rollout.kernels.linears import gated_mlp, gated_ref, linear, linear_add_norm, linear_ref, tuned_linear
from dschat.rollout.kernels.norm import add_norm, add_norm_ref
from dschat.rollout.kernels.options import KernelOptions, options, use_options

__all__ = ["KernelOptions", "add_norm", "add_norm_ref", "argmax", "argmax_ref", "available", "decode_attention",
           "decode_attention_ref", "gated_mlp", "gated_ref", "hf_gelu", "hf_gelu_ref", "linear", "linear_add_norm",
           "linear_ref", "new_gelu", "new_gelu_ref", "options", "rope_", "rope_ref_", "tuned_linear", "use_options",
           "write_kv_ref"]
