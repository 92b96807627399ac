"""Step-3 runs with probes on the trainer, in one multi-rank launch:
`deepspeed --num_gpus 2 tests/dist/step3_probe.py --plan plan.json`.

plan.json: {"runs": [{"name": ..., "argv": [...]}, ...], "out": "results"}; each run calls
step 3's `main(argv)` in this process and every rank writes "out".<name>.rank<k>.json with:
  modes         per scoring call: which models had any submodule in train mode
  reward_repeat per generation: max |reward - reward scored again| (same sequences)
  first_micro   per PPO round: max |log-ratio| and clip fraction of its first micro-step
  log_ratio_max max |log-ratio| over every micro-step (masked)
  kl_end / score_end  per generation: the KL-reward's last position / the reward model's
                      end-score token, both as columns of seq
  ptx           per round: the ptx rows given to the round, the rows trained, actor optimizer
                steps before/after
  steps         actor/critic optimizer steps, scheduler steps, num_total_iters, LR history
  hole          (run option) row 0's answer gets a pad token at its second position
  ema           (with --enable_ema) max |ema - expected| for one update, |ema - sft|, |actor - sft|
"""
import argparse
import importlib.util
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_main_module():
    spec = importlib.util.spec_from_file_location("step3_main", REPO / "training/step3_rlhf_finetuning/main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def any_training(engine) -> bool:
    return engine is not None and any(m.training for m in engine.module.modules())


def run_one(run: dict, rank: int, out_prefix: str) -> None:
    import torch

    from dschat.rlhf import loop as L
    from dschat.rlhf import ppo_math as pm
    from dschat.rlhf import trainer as T

    main_mod = load_main_module()
    rec = {"modes": [], "reward_repeat": [], "first_micro": [], "log_ratio_max": 0.0, "kl_end": [],
           "score_end": [], "ptx": [], "lr": [], "steps": {}}
    state = {"first": False}
    box = {}

    real_build = L.build_rlhf_engines

    def build(args, tokenizer, num_total_iters, scheduler=None):
        engines = real_build(args, tokenizer, num_total_iters, scheduler)
        box.update(engines=engines, total=num_total_iters, args=args)
        real_fv = engines.reward.module.forward_value

        def forward_value(seq, attention_mask=None, return_value_only=False):
            rec["modes"].append({name: any_training(getattr(engines, name))
                                 for name in ("actor", "ref", "critic", "reward", "ema")})
            out = real_fv(seq, attention_mask, return_value_only)
            again = real_fv(seq, attention_mask, return_value_only)["chosen_end_scores"]
            rec["reward_repeat"].append(float((again - out["chosen_end_scores"]).abs().max()))
            ends = engines.reward.module._ends(seq, attention_mask) - 1
            rec["score_end"].append(ends.tolist())
            return out
        engines.reward.module.forward_value = forward_value
        if run.get("hole"):
            real_generate = engines.hybrid.generate

            def generate(prompts, *a, **k):
                # a pad token inside row 0's answer: a hole in its attention and action masks
                seq = real_generate(prompts, *a, **k).clone()
                seq[0, prompts.shape[1] + 1] = k["pad_token_id"]
                return seq
            engines.hybrid.generate = generate
        return engines

    real_kl = pm.compute_kl_rewards

    def compute_kl_rewards(logprobs, ref_logprobs, reward_score, action_mask, kl_ctl, clip):
        out = real_kl(logprobs, ref_logprobs, reward_score, action_mask, kl_ctl, clip)
        # the column of seq where the score landed: P + answer index of the last mask 1
        kl_only = real_kl(logprobs, ref_logprobs, torch.zeros_like(reward_score), action_mask, kl_ctl, clip)
        hit = (out - kl_only).abs() > 0
        P = box["P"]
        rec["kl_end"].append([P + int(h.nonzero().max()) if h.any() else -1 for h in hit])
        return out

    real_actor_loss = pm.actor_loss

    def actor_loss(logprobs, old_logprobs, advantages, mask, cliprange):
        loss, clip = real_actor_loss(logprobs, old_logprobs, advantages, mask, cliprange)
        ratio = ((logprobs.detach() - old_logprobs) * mask).abs().max().item()
        rec["log_ratio_max"] = max(rec["log_ratio_max"], ratio)
        if state["first"]:
            rec["first_micro"].append({"log_ratio": ratio, "clip_frac": float(clip)})
            state["first"] = False
        return loss, clip

    real_round = L.ppo_round

    def ppo_round(trainer, buffer, unsup_buffer, args):
        e = box["engines"]
        state["first"] = True
        given = [row for b in unsup_buffer for row in b["input_ids"].tolist()]
        trained = []
        real_unsup = trainer.train_unsupervised

        def train_unsupervised(batch):
            trained.extend(batch["input_ids"].tolist())
            return real_unsup(batch)
        trainer.train_unsupervised = train_unsupervised
        before = (e.actor.global_steps, e.critic.global_steps)
        try:
            out = real_round(trainer, buffer, unsup_buffer, args)
        finally:
            del trainer.train_unsupervised
        rec["ptx"].append({"given": given, "trained": trained, "actor_steps": [before[0], e.actor.global_steps],
                           "critic_steps": [before[1], e.critic.global_steps]})
        rec["lr"].append(e.actor.get_lr()[0])
        return out

    real_gen = T.PPOTrainer.generate_experience

    def generate_experience(self, prompts, prompt_mask):
        box["P"] = prompts.shape[1]
        return real_gen(self, prompts, prompt_mask)

    # step 3's loop (dschat/rlhf/loop.py) builds the engines and runs each PPO round
    L.build_rlhf_engines, L.ppo_round = build, ppo_round
    pm.compute_kl_rewards, pm.actor_loss = compute_kl_rewards, actor_loss
    T.PPOTrainer.generate_experience = generate_experience
    try:
        main_mod.main(run["argv"])
    finally:
        L.build_rlhf_engines, L.ppo_round = real_build, real_round
        pm.compute_kl_rewards, pm.actor_loss = real_kl, real_actor_loss
        T.PPOTrainer.generate_experience = real_gen
    e = box["engines"]
    rec["steps"] = {"actor": e.actor.global_steps, "critic": e.critic.global_steps,
                    "actor_sched": e.actor.lr_scheduler.last_epoch, "critic_sched": e.critic.lr_scheduler.last_epoch,
                    "num_total_iters": box["total"], "actor_lr_end": e.actor.get_lr()[0],
                    "critic_lr_end": e.critic.get_lr()[0], "actor_gas": e.actor.gradient_accumulation_steps()}
    if e.ema is not None:
        rec["ema"] = ema_report(e, box["args"])
    with open(f"{out_prefix}.{run['name']}.rank{rank}.json", "w") as f:
        json.dump(rec, f)


def ema_report(e, args) -> dict:
    """|ema - sft|, |merged actor - sft| and |ema - (beta sft + (1 - beta) actor)| (the EMA
    after exactly one update), over all weights the EMA holds."""
    from safetensors.torch import load_file

    from dschat.engine.zero import full_state_dict
    from dschat.models.lora import merged_state_dict
    from dschat.rlhf.trainer import PPOConfig

    beta = PPOConfig.ema_beta
    actor = merged_state_dict(e.actor.module, full_state_dict(e.actor, rank0_only=False))
    ema = full_state_dict(e.ema, rank0_only=False)
    sft = load_file(str(Path(args.actor_model_name_or_path) / "model.safetensors"))
    out = {"ema_vs_sft": 0.0, "actor_vs_sft": 0.0, "ema_vs_one_update": 0.0, "compared": 0}
    for name, value in ema.items():
        if name not in sft or name not in actor or sft[name].shape != value.shape:
            continue
        s, a, v = sft[name].float(), actor[name].float(), value.float()
        out["compared"] += 1
        out["ema_vs_sft"] = max(out["ema_vs_sft"], float((v - s).abs().max()))
        out["actor_vs_sft"] = max(out["actor_vs_sft"], float((a - s).abs().max()))
        out["ema_vs_one_update"] = max(out["ema_vs_one_update"],
                                       float((v - (beta * s + (1 - beta) * a)).abs().max()))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for run in plan["runs"]:
        run_one(run, rank, plan["out"])
        print(f"probe: run {run['name']} done", flush=True)


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)
