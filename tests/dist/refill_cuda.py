"""The replica refill on a CUDA device (world size 1, ZeRO-3, NCCL): after an optimizer step,
every replica tensor (fp32, and bf16 through the cast) equals the gathered parameter, straight
from the shards and through DeepSpeed's fetch alike, for the full and the layered replica.
Run by tests/test_hybrid.py::test_refill_on_cuda (GPU only)."""
import sys

import torch

import hybrid_common as hc


def main():
    import deepspeed
    import transformers as T
    from dschat.rollout import gather as G
    from dschat.engine.zero import params_left_gathered

    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(0)
    torch.manual_seed(hc.SEED)
    cfg = T.BloomConfig(vocab_size=hc.VOCAB + 1, hidden_size=63, n_layer=3, n_head=7,
                        bos_token_id=hc.BOS, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    engine = hc.make_engine(T.BloomForCausalLM(cfg), stage=3, persistence=100)
    device = torch.device("cuda", 0)
    res = {}
    replicas = {(dtype, direct): G.build_replica(engine.module, dtype, device)
                for dtype in (torch.float32, torch.bfloat16) for direct in (True, False)}
    ids, mask = hc.prompts(0)
    ids, mask = ids.to(device), mask.to(device)
    for step in range(2):
        hc.train_step(engine, ids, mask)
        with G.gathered(engine.module):
            want = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        for (dtype, direct), rep in replicas.items():
            G.DIRECT_FILL = direct
            G.fill_replica(engine.module, rep, scheduler=G.GatherScheduler())
            got = dict(rep.named_parameters())
            ok = all(torch.equal(got[n], w.to(dtype)) for n, w in want.items())
            res[f"step{step} {dtype} {'direct' if direct else 'deepspeed'}"] = ok
        for direct in (True, False):      # layered: every chunk through the forward hooks
            G.DIRECT_FILL = direct
            lay = G.LayeredReplica(engine.module, group_size=2, dtype=torch.float32, device=device,
                                   scheduler=G.GatherScheduler())
            lay.fill()
            with lay.session(), torch.no_grad():
                logits = lay.model(ids, attention_mask=mask).logits
                full = replicas[(torch.float32, True)](ids, attention_mask=mask).logits
            res[f"step{step} layered {'direct' if direct else 'deepspeed'}"] = bool(torch.equal(logits, full))
            lay.close()
    G.DIRECT_FILL = True
    res["left_gathered"] = params_left_gathered(engine.module)
    print("REFILL_CUDA", res)
    ok = all(v for k, v in res.items() if k != "left_gathered") and not res["left_gathered"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
