"""Pieces shared by the step-1 and step-2 training loops."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dschat.engine.zero import release_prefetched
from dschat.utils.dist import all_reduce_sum, get_rank, get_world_size, peak_memory_gib
from dschat.utils.logging import print_rank_0

if TYPE_CHECKING:
    from dschat.utils.checkpoint import NonFiniteGuard


def make_loader(dataset: Dataset, batch_size: int, collate_fn=None, *, shuffle: bool,
                seed: int, drop_last: bool = False) -> DataLoader:
    """A rank-sharded loader: rank r sees items r, r+W, ... of the seeded permutation.

    So the union of one step's micro-batches over W ranks is the same global batch a
    single rank with a W-times larger micro-batch would see (tested: ZeRO-3 on 2 ranks
    equals ZeRO-0 on 1 rank).
    """
    sampler = DistributedSampler(dataset, num_replicas=get_world_size(), rank=get_rank(),
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    # Its own generator: starting an iterator then draws no number from the global torch
    # RNG, so where an epoch's iterator starts does not shift dropout (exact resume).
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, generator=torch.Generator().manual_seed(seed))


def log_train_step(metrics, progress, engine, *, step: int, epoch: int, seconds: float, device,
                   loss: float | None, skipped: int, print_loss: bool) -> None:
    """The per-step record of steps 1 and 2 (lr, epoch, time, peak memory, updates skipped as
    non-finite, and the loss unless this step's update was skipped) and the progress bar."""
    record = {"train/lr": engine.get_lr()[0], "train/epoch": epoch, "time/step_s": seconds,
              "memory/peak_gib": peak_memory_gib(device), "train/skipped_nonfinite": skipped}
    if loss is not None:
        record["train/loss"] = loss
        progress.set_postfix(loss=f"{loss:.4f}")
        if print_loss:
            print_rank_0(f"epoch {epoch} step {step} loss {loss:.6f}")
    metrics.log(step, record)


def abandon_accumulation(engine) -> None:
    """Drop an optimizer step that will not be taken (a micro-batch's loss was not finite):
    forget the gradients its earlier micro-batches accumulated and rewind DeepSpeed's
    micro-step counter, so the next micro-batch starts a fresh accumulation window.

    Every rank calls it together, instead of that micro-batch's backward and step.
    ZeRO optimizers restart accumulation on `zero_grad` (the next backward overwrites
    their gradient partitions); without ZeRO the module's `.grad`s are dropped.
    """
    micro_batches_done = engine.micro_steps % engine.gradient_accumulation_steps()
    if micro_batches_done == 0:
        return
    if engine.zero_optimization():
        engine.optimizer.zero_grad(set_to_none=True)
    else:
        engine.zero_grad()
    engine.micro_steps -= micro_batches_done


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def micro_batch_groups(loader: DataLoader, accumulation: int) -> Iterator[list[dict]]:
    """Yield the micro-batches of each optimizer step together (the last group may be short)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == accumulation:
            yield group
            group = []
    if group:
        yield group


def token_count(batches: list[dict]) -> torch.Tensor:
    """Loss tokens (labels != -100 after the causal shift) in these micro-batches."""
    return torch.tensor(float(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)))


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """Summed next-token cross-entropy over label tokens (labels -100 are ignored)."""
    logits = logits[:, :-1]
    if fp32:
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def sft_train_step(engine, group, device, accumulation: int, world: int, guard: "NonFiniteGuard",
                   step: int) -> float | None:
    """Step 1 (SFT): one optimizer step over `group` micro-batches, loss weighted by global
    token count.

    Each micro-batch's summed loss is scaled so that, after DeepSpeed averages gradients
    over ranks and accumulation steps, the update is the mean over every loss token of
    the global batch; a step's loss then does not depend on how it was split into
    micro-batches and ranks. A non-finite loss on any rank skips the whole update on
    every rank (None is returned).
    """
    engine.train()  # every step: a resumed run skips the first eval, and from_pretrained models start in eval
    tokens = all_reduce_sum(token_count(group)).item()
    scale = world * accumulation / max(tokens, 1.0)  # DeepSpeed divides by both
    total = torch.zeros((), device=device)
    for i, batch in enumerate(group):
        batch = to_device(batch, device)
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        use_cache=False).logits
        loss_sum = lm_loss_sum(logits, batch["labels"])
        if not guard.ok("loss", step, loss_sum, micro=i):
            abandon_accumulation(engine)
            return None
        engine.backward(loss_sum * scale)
        engine.step()
        total += loss_sum.detach()
    return all_reduce_sum(total).item() / max(tokens, 1.0)


@torch.no_grad()
def evaluate_lm(engine, loader: DataLoader, device, max_batches: int) -> dict:
    """Token-weighted eval loss and perplexity over all ranks."""
    engine.eval()
    total = torch.zeros(2, device=device)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = to_device(batch, device)
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        use_cache=False).logits
        total[0] += lm_loss_sum(logits, batch["labels"])
        total[1] += (batch["labels"][:, 1:] != -100).sum()
    total = all_reduce_sum(total)
    release_prefetched(engine)  # nothing left in flight for a save or the next gather
    engine.train()
    loss = (total[0] / total[1].clamp(min=1)).item()
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
