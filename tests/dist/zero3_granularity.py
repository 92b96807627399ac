"""ZeRO-3 with block-granular gather hooks (dschat.engine.zero.use_block_granularity)
against DeepSpeed's per-module hooks, on 2 CPU ranks: the same weights and batches give the
same losses and the same updated weights, every transformer block is a leaf, and far fewer
sub-module fetches run. Bloom, OPT and LLaMA causal LMs and a Bloom reward model (critic);
Bloom with activation checkpointing as well."""
import torch
import deepspeed
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed.utils import z3_leaf_module
from transformers import AutoConfig, AutoModelForCausalLM

from dschat.engine.config import train_ds_config
from dschat.utils.dist import init_distributed
from dschat.engine.zero import block_class_name, full_state_dict, use_block_granularity
from dschat.models.reward_model import RewardModel
from dschat.utils.run import main_guard

CONFIGS = {
    "bloom": dict(vocab_size=128, hidden_size=32, n_layer=3, n_head=4),
    "opt": dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
                max_position_embeddings=64, word_embed_proj_dim=32),
    "llama": dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64),
}

fetches = {"n": 0}
_fetch = PartitionedParameterCoordinator.fetch_sub_module


def _counting_fetch(self, *args, **kwargs):
    fetches["n"] += 1
    return _fetch(self, *args, **kwargs)


PartitionedParameterCoordinator.fetch_sub_module = _counting_fetch


def build(family: str, critic: bool):
    cfg = AutoConfig.for_model(family, **CONFIGS[family])
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if critic:
        model = RewardModel(model.base_model, pad_token_id=0)
    return model


def run(family: str, critic: bool, granularity: str, rank: int, checkpointing: bool = False,
        old_deepspeed: bool = False):
    model = build(family, critic)
    if checkpointing:
        model.gradient_checkpointing_enable()
    ds_config = train_ds_config(zero_stage=3, dtype="fp32", micro_batch_size=2, persistence_threshold=0)
    use_block_granularity(ds_config, model, granularity)
    if old_deepspeed:      # DeepSpeed < 0.18 has no leaf_module config: the marked blocks alone
        assert ds_config["zero_optimization"].pop("leaf_module")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    blocks = [m for m in model.modules() if type(m).__name__ == block_class_name(model)]
    assert len(blocks) == 3, (family, critic, len(blocks))
    assert all(z3_leaf_module(b) == (granularity == "block") for b in blocks), (family, granularity)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    fetches["n"] = 0
    for _ in range(3):
        ids = torch.randint(1, 128, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        if critic:
            loss = engine.module.forward_value(ids, mask, return_value_only=True).float().pow(2).mean()
        else:
            loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    n = fetches["n"]
    state = full_state_dict(engine, rank0_only=False)
    return losses, state, n


def main():
    init_distributed()
    rank = torch.distributed.get_rank()
    for family, critic in [("bloom", False), ("opt", False), ("llama", False), ("bloom", True)]:
        lb, sb, nb = run(family, critic, "block", rank)
        if (family, critic) == ("bloom", False):
            lb_bloom, nb_bloom = lb, nb
        lm, sm, nm = run(family, critic, "module", rank)
        assert max(abs(a - b) for a, b in zip(lb, lm)) < 1e-6, (family, critic, lb, lm)
        # Adam turns last-bit gradient differences on near-zero gradients into steps of up
        # to lr (1e-2); a wrong gradient would move weights by that much, not by 1e-5
        for k in sm:
            torch.testing.assert_close(sb[k], sm[k], atol=1e-4, rtol=1e-4, msg=lambda m: f"{family} {k}: {m}")
        assert nb * 2 < nm, (family, critic, nb, nm)
        print(f"rank {rank} {family}{' critic' if critic else ''}: losses {lb} equal; fetches {nb} vs {nm}",
              flush=True)
    lo, so, no = run("bloom", False, "block", rank, old_deepspeed=True)
    assert lo == lb_bloom and no == nb_bloom, (lo, lb_bloom, no, nb_bloom)
    print(f"rank {rank} bloom, blocks marked without the config key: same losses and fetches", flush=True)
    # activation checkpointing recomputes each block in backward: its pre-forward hook
    # gathers the block again; same numbers as without checkpointing
    lc, sc, _ = run("bloom", False, "block", rank, checkpointing=True)
    lm, sm, _ = run("bloom", False, "module", rank)
    assert max(abs(a - b) for a, b in zip(lc, lm)) < 1e-6, (lc, lm)
    for k in sm:
        torch.testing.assert_close(sc[k], sm[k], atol=1e-4, rtol=1e-4, msg=lambda m: f"checkpointing {k}: {m}")
    print(f"rank {rank} bloom checkpointed: losses {lc} equal", flush=True)
    if rank == 0:
        print("OK")


if __name__ == "__main__":
    main_guard(main)
