"""Step 2's reward-model training: one optimizer step over the pairs of a global batch and
the pairwise evaluation (the entry point is training/step2_reward_model_finetuning/main.py;
the model itself is dschat.models.reward_model)."""
from __future__ import annotations

import torch

from dschat.engine.train_utils import abandon_accumulation, to_device
from dschat.engine.zero import release_prefetched
from dschat.utils.checkpoint import NonFiniteGuard
from dschat.utils.dist import all_reduce_sum


def train_step(engine, group, device, world: int, guard: NonFiniteGuard, step: int) -> float | None:
    """One optimizer step over `group` micro-batches; the mean pair loss over ranks.
    A non-finite loss on any rank skips the whole update on every rank (None)."""
    engine.train()  # every step: a resumed run skips the first eval, and from_pretrained models start in eval
    loss = torch.zeros((), device=device)
    for i, batch in enumerate(group):
        batch = to_device(batch, device)
        out = engine(batch["input_ids"], batch["attention_mask"])
        if not guard.ok("loss", step, out["loss"], micro=i):
            abandon_accumulation(engine)
            return None
        engine.backward(out["loss"])
        engine.step()
        loss += out["loss"].detach().float() / len(group)
    return (all_reduce_sum(loss) / world).item()


@torch.no_grad()
def evaluate(engine, loader, device, max_batches: int) -> dict:
    """Accuracy (chosen score > rejected score) and mean scores over all ranks."""
    engine.eval()
    totals = torch.zeros(4, device=device)  # correct, pairs, chosen sum, rejected sum
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = to_device(batch, device)
        out = engine(batch["input_ids"], batch["attention_mask"])
        chosen, rejected = out["chosen_mean_scores"].float(), out["rejected_mean_scores"].float()
        totals += torch.stack([(chosen > rejected).sum().float(), torch.tensor(float(chosen.numel()), device=device),
                               chosen.sum(), rejected.sum()])
    totals = all_reduce_sum(totals)
    release_prefetched(engine)  # nothing left in flight for a save or the next gather
    engine.train()
    pairs = totals[1].clamp(min=1)
    return {"acc": (totals[0] / pairs).item(), "chosen_score": (totals[2] / pairs).item(),
            "rejected_score": (totals[3] / pairs).item()}
