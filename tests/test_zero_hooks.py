"""Block-granular ZeRO-3 hooks (`--zero3_hook_granularity`, dschat.engine.zero)."""
import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from dschat.engine.config import eval_ds_config, train_ds_config
from dschat.engine.zero import block_class_name, use_block_granularity
from dschat.models.reward_model import RewardModel
from tests.dist_utils import REPO, run_deepspeed

TINY = {
    "bloom": (dict(vocab_size=64, hidden_size=16, n_layer=2, n_head=2), "BloomBlock"),
    "opt": (dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                 word_embed_proj_dim=16), "OPTDecoderLayer"),
    "llama": (dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=32), "LlamaDecoderLayer"),
    "gpt_neox": (dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32), "GPTNeoXLayer"),
    "gpt2": (dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2), "GPT2Block"),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_block_class_of_causal_lm_and_reward_backbone(family):
    kwargs, expected = TINY[family]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kwargs))
    assert block_class_name(model) == expected
    assert block_class_name(RewardModel(model.base_model, pad_token_id=0)) == expected


def test_leaf_classes_only_at_zero3_and_only_for_block_granularity():
    kwargs, _ = TINY["bloom"]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", **kwargs))
    cfg = use_block_granularity(train_ds_config(zero_stage=3, dtype="fp32", micro_batch_size=1), model)
    classes = cfg["zero_optimization"]["leaf_module"]["classes"]
    assert classes[-1] == "BloomBlock"
    # prefetch one block ahead: bucket >= one block, live limit >= two (upstream's 3e7 here)
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 3e7
    big = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", vocab_size=64, hidden_size=1024,
                                                                n_layer=1, n_head=2))
    block_numel = sum(p.numel() for p in big.transformer.h[0].parameters())
    zero = use_block_granularity(train_ds_config(zero_stage=3, dtype="fp32", micro_batch_size=1,
                                                 prefetch_bucket_size=1e6, max_live_parameters=1e6),
                                 big)["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == block_numel
    assert zero["stage3_max_live_parameters"] == 2 * block_numel
    assert any("MixtralSparseMoeBlock" in c for c in classes)   # DeepSpeed's defaults stay
    assert use_block_granularity(cfg, model)["zero_optimization"]["leaf_module"]["classes"] == classes
    for cfg in (train_ds_config(zero_stage=2, dtype="fp32", micro_batch_size=1),
                eval_ds_config(zero_stage=0, dtype="fp32")):
        assert "leaf_module" not in use_block_granularity(cfg, model)["zero_optimization"]
    module = use_block_granularity(train_ds_config(zero_stage=3, dtype="fp32", micro_batch_size=1), model,
                                   "module")
    assert "leaf_module" not in module["zero_optimization"]
    with pytest.raises(ValueError, match="granularity"):
        use_block_granularity(train_ds_config(zero_stage=3, dtype="fp32", micro_batch_size=1), model, "layer")


def test_frozen_stage_rule():
    """Frozen models follow their trained partner's ZeRO-3 on several ranks (upstream's
    rule), run unpartitioned on one rank unless offloaded, and the flag always wins."""
    from dschat.engine.config import frozen_stage
    assert frozen_stage(None, 3) == 3 and frozen_stage(None, 2) == 0            # rank count unknown
    assert frozen_stage(None, 3, world_size=2) == 3 and frozen_stage(None, 3, world_size=1) == 0
    assert frozen_stage(None, 3, world_size=1, offloaded=True) == 3            # host offload needs ZeRO-3
    assert frozen_stage(None, 0, world_size=8) == 0
    assert frozen_stage(3, 3, world_size=1) == 3 and frozen_stage(0, 3, world_size=4) == 0


def test_offload_knobs_in_the_deepspeed_config():
    """--offload keeps upstream's meaning (parameters and optimizer state on the host at
    ZeRO-3); --offload_optimizer_only keeps the parameters on the GPU; --offload_ratio < 1
    is DeepSpeed's partial offload, parameters on the GPU."""
    def zero(**kw):
        return train_ds_config(zero_stage=3, dtype="bf16", micro_batch_size=1, **kw)["zero_optimization"]
    assert zero(offload=True)["offload_param"] == {"device": "cpu"}
    assert zero(offload=True)["offload_optimizer"] == {"device": "cpu"}
    assert zero(offload=True, offload_params=False)["offload_param"] == {"device": "none"}
    partial = zero(offload=True, offload_ratio=0.6)
    assert partial["offload_optimizer"] == {"device": "cpu", "ratio": 0.6}
    assert partial["offload_param"] == {"device": "none"} and partial["sub_group_size"] == 2e8
    assert "sub_group_size" not in zero(offload=True)      # DeepSpeed's default without a ratio
    assert zero()["offload_optimizer"] == {"device": "none"} and zero()["offload_param"] == {"device": "none"}
    pinned = zero(offload=True, offload_params=False, offload_pin_memory=True)
    assert pinned["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert pinned["offload_param"] == {"device": "none"}
    assert zero(offload=True, offload_pin_memory=True)["offload_param"] == {"device": "cpu", "pin_memory": True}
    stage2 = train_ds_config(zero_stage=2, dtype="bf16", micro_batch_size=1, offload=True)["zero_optimization"]
    assert stage2["offload_param"] == {"device": "none"} and stage2["offload_optimizer"] == {"device": "cpu"}


def test_block_hooks_train_like_module_hooks_on_two_ranks():
    """Real ZeRO-3 across 2 CPU ranks: same losses (1e-6) and weights after 3 AdamW steps,
    every block a leaf, fewer than half the sub-module fetches (Bloom, OPT, LLaMA, critic)."""
    proc = run_deepspeed(REPO / "tests" / "dist" / "zero3_granularity.py", timeout=600)
    assert "OK" in proc.stdout, proc.stdout[-3000:]
    for family in ("bloom", "opt", "llama", "bloom critic"):
        assert f"rank 1 {family}:" in proc.stdout
