"""`--optimizer_dtype bf16` inside real DeepSpeed engines on 2 CPU ranks.

    deepspeed --num_gpus 2 tests/dist/bf16_optimizer.py --stage {2,3} --out PATH

For fp32 and bf16 optimizer state, the same tiny Bloom trains 6 steps on the same batches
(bf16 weights, ZeRO `--stage`); each rank writes PATH.rank<k>.json with what DeepSpeed holds
(the master weights' dtype, whether they are the bf16 partition itself, the moments' dtype,
optimizer bytes per trained element), the losses, and a checkpoint round trip: the master
weights and moments after `load_checkpoint` in a fresh engine against those saved, and how
many gradients the last step tested for NaN/inf one at a time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.dist import hybrid_common as hc  # noqa: E402


def master_partitions(optimizer) -> list[torch.Tensor]:
    """The master weights the ZeRO optimizer steps (stage 3: per sub-group; 1/2: per group)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def low_precision_partitions(optimizer) -> list[torch.Tensor]:
    if hasattr(optimizer, "fp16_partitioned_groups_flat"):
        return list(optimizer.fp16_partitioned_groups_flat)
    rank = torch.distributed.get_rank()
    return [groups[rank] for groups in optimizer.parallel_partitioned_bit16_groups]


def fingerprint(optimizer) -> list[float]:
    """Sums of the master partitions and of both moments (fp64), in a fixed order."""
    out = [float(m.double().sum()) for m in master_partitions(optimizer)]
    inner = optimizer.optimizer
    for m in master_partitions(optimizer):
        state = inner.state.get(m, {})
        out += [float(state[k].double().sum()) for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def build(stage: int, optimizer_dtype: str):
    from dschat.engine.config import train_ds_config
    from dschat.engine.optim import build_optimizer
    from dschat.engine.zero import initialize_engine
    model = hc.tiny_model("bloom")
    config = train_ds_config(zero_stage=stage, dtype="bf16", micro_batch_size=4, optimizer_dtype=optimizer_dtype,
                             persistence_threshold=0)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, lora_lr=1e-3, offload=False,
                                optimizer_dtype=optimizer_dtype)
    return initialize_engine(model, config, "block", optimizer=optimizer)


def batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(3, hc.VOCAB, (4, 24), generator=g) for _ in range(n)]


def step(engine, ids) -> float:
    engine.train()
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    rank, _ = hc.init()
    res = {}
    data = batches(rank, 6)
    for optimizer_dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        engine = build(args.stage, optimizer_dtype)
        zero = engine.optimizer
        masters, low = master_partitions(zero), low_precision_partitions(zero)
        losses = [step(engine, ids) for ids in data[:3]]
        states = [s for m in masters for s in zero.optimizer.state.get(m, {}).values()
                  if torch.is_tensor(s) and s.numel() > 1]
        trained = sum(m.numel() for m in masters)
        separate_master = sum(m.numel() * m.element_size() for m, lp in zip(masters, low)
                              if m.data_ptr() != lp.data_ptr())
        r = {"optimizer": type(zero.optimizer).__name__,
             "master_dtype": str(masters[0].dtype),
             "master_is_the_bf16_partition": all(m.data_ptr() == lp.data_ptr() for m, lp in zip(masters, low)),
             "moment_dtypes": sorted({str(s.dtype) for s in states}),
             # master copy (when separate) and moments per trained element, the gradients aside
             "optimizer_bytes_per_element": (separate_master + sum(s.numel() * s.element_size() for s in states))
             / trained,
             # ZeRO-3's contiguous reduce bucket, allocated up front (elements per gradient dtype)
             "reduce_bucket_elements": sorted({b.buffer.numel() for b in zero.ipg_buckets.values()
                                               if b.buffer is not None}) if args.stage == 3 else None}
        ckpt = Path(tempfile.gettempdir()) / f"bf16_opt_ckpt_{args.stage}_{optimizer_dtype}"
        engine.save_checkpoint(str(ckpt), tag="t")
        r["saved"] = fingerprint(zero)
        losses += [step(engine, ids) for ids in data[3:-1]]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            losses.append(step(engine, data[-1]))
        # DeepSpeed's ZeRO-1/2 NaN/inf test reduces each gradient with amax and amin
        r["per_gradient_overflow_tests"] = sum(e.name == "aten::amin" for e in prof.events())
        r["gradients"] = sum(p.requires_grad for p in engine.module.parameters())
        r["losses"] = losses
        fresh = build(args.stage, optimizer_dtype)
        fresh.load_checkpoint(str(ckpt), tag="t")
        r["loaded"] = fingerprint(fresh.optimizer)
        res[optimizer_dtype] = r
        del engine, fresh
    hc.write_results(res, rank)


if __name__ == "__main__":
    main()
