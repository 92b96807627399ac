"""Step 3's run: data and engines from the flags, the resumable rollout -> experience ->
update loop with its metrics, checkpoints and profiling, and the final save
(training/step3_rlhf_finetuning/main.py parses and validates the flags, then calls
`train_step3`)."""
import json
import os
import time
from itertools import chain, cycle

import torch
from tqdm import tqdm

from dschat.data import DataCollatorRLHF, create_prompt_dataset, create_unsupervised_dataset
from dschat.data.chat import ChatFormat
from dschat.data.tokenize import end_of_conversation_text
from dschat.engine.train_utils import abandon_accumulation, make_loader, to_device
from dschat.engine.zero import final_save_host_bytes
from dschat.models.model_utils import load_tokenizer, save_hf_format
from dschat.models.reward_model import save_reward_model
from dschat.rlhf.algorithm import kl_settings, reward_fn_specs, reward_weights, uses_reward_model
from dschat.rlhf.engine import build_rlhf_engines, ppo_optimizer_steps
from dschat.rlhf.reward_fn import describe, load_reward_fn
from dschat.rlhf.trainer import PPOConfig, PPOTrainer, RewardFn, merge_rollout_metrics
from dschat.rollout.gather import get_scheduler
from dschat.utils.checkpoint import Checkpointer, NonFiniteGuard, fault_point, skip_batches
from dschat.utils.dist import (
    all_reduce_mean,
    all_reduce_sum,
    allocator_metrics,
    get_rank,
    get_world_size,
    host_peak_gib,
    init_distributed,
    peak_memory_gib,
)
from dschat.utils.errors import UserInputError
from dschat.utils.logging import print_rank_0
from dschat.utils.metrics import metrics_logger_for
from dschat.utils.profiling import StepProfiler
from dschat.utils.run import resolved_config, save_json, set_seed


def _problems(problems: list[str]) -> None:
    """Data that cannot make one batch: one UserInputError, as flag problems are reported."""
    raise UserInputError("invalid flags:\n  - " + "\n  - ".join(problems))


def ppo_config(args) -> PPOConfig:
    do_sample = any(v is not None for v in (args.temperature, args.top_p, args.top_k))
    kl_estimator, kl_in = kl_settings(args)
    weights = reward_weights(args)
    if weights is not None and args.critic_model_name_or_path and not uses_reward_model(args):
        weights = weights[1:]    # the reward model's weight 0: it is not built, so not among the rewards
    return PPOConfig(kl_ctl=args.kl_ctl, clip_reward_value=args.clip_reward_value, cliprange=args.cliprange,
                     cliprange_value=args.cliprange_value, gamma=args.gamma, lam=args.lam,
                     max_answer_seq_len=args.max_answer_seq_len, min_answer_seq_len=args.min_answer_seq_len,
                     unsup_coef=args.unsup_coef, do_sample=do_sample,
                     temperature=args.temperature or 1.0, top_k=args.top_k or 0, top_p=args.top_p or 1.0,
                     algorithm=args.algorithm, n_samples_per_prompt=args.n_samples_per_prompt,
                     std_norm=not args.no_std_norm, kl_estimator=kl_estimator, kl_in=kl_in,
                     kl_target=args.kl_target, kl_horizon=args.kl_horizon, loss_agg=args.loss_agg,
                     cliprange_low=args.cliprange_low, cliprange_high=args.cliprange_high,
                     overlong_buffer=args.overlong_penalty, skip_bad_rewards=args.skip_bad_rewards,
                     reward_weights=weights, filter_max_extra=args.filter_groups_max_extra,
                     fused_logprobs=args.logprobs == "fused",
                     score_in_training_forward=args.score_in_training_forward)


def reward_functions(args) -> list[RewardFn]:
    """The loaded --reward_fn functions, in order."""
    out = []
    for spec in reward_fn_specs(args):
        fn = load_reward_fn(spec)
        out.append(RewardFn(name=getattr(fn, "__name__", spec.rpartition(":")[2]), label=describe(fn), fn=fn))
    return out


def dump_generations(path, step, exp, tokenizer, this_rank):
    """Gather every rank's prompts/answers to rank 0 and append them as JSONL rows."""
    P = exp.prompt_width
    rows = []
    for i in range(exp.batch_size):
        prompt = exp.seq[i, :P][exp.attention_mask[i, :P].bool()]
        answer = exp.seq[i, P:][exp.attention_mask[i, P:].bool()]
        rows.append({"step": step, "rank": this_rank,
                     "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                     "answer": tokenizer.decode(answer, skip_special_tokens=True),
                     "reward": float(exp.rewards[i])})
    gathered = [None] * get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if this_rank == 0:
        with open(path, "a") as f:
            for part in gathered:
                for row in part:
                    f.write(json.dumps(row) + "\n")
    return rows


def split_rows(batch: dict, micro_batch_size: int) -> list[dict]:
    """A collated batch cut into consecutive micro-batches of rows (the last may be smaller)."""
    rows = next(len(v) for v in batch.values() if torch.is_tensor(v))
    return [{k: v[i:i + micro_batch_size] if torch.is_tensor(v) else v for k, v in batch.items()}
            for i in range(0, rows, micro_batch_size)]


def ppo_round(trainer, buffer, unsup_buffer, args) -> dict:
    """--ppo_epochs passes of actor/critic (+ ptx) updates over the buffered experience;
    the mean of each statistic over the round and the ranks.

    A ptx batch has as many rows as a generation batch and is cut like it (upstream's
    MiniDataset): each PPO micro-batch trains with its own ptx micro-batch, so every ptx
    row is trained once per PPO epoch."""
    if os.environ.get("DSCHAT_EMPTY_CACHE") == "1" and torch.cuda.is_available():
        # a benchmark switch (benchmarks/step3.py): the caching allocator's free blocks left by
        # generation and scoring returned before training, against the allocator's reserved peak
        torch.cuda.empty_cache()
    stats = []
    for _ in range(args.ppo_epochs):
        for exp_i, unsup in zip(buffer, unsup_buffer or [None] * len(buffer)):
            # a rollout scored in its training forward (--score_in_training_forward) is one micro-batch
            # and gets its log-probs, values and advantages filled in place, for the metrics
            micros = [exp_i] if exp_i.logprobs is None else exp_i.split(args.per_device_training_batch_size)
            unsup_micros = split_rows(unsup, args.per_device_training_batch_size) if unsup is not None \
                else [None] * len(micros)
            if len(unsup_micros) != len(micros):
                raise RuntimeError(f"{len(unsup_micros)} ptx micro-batches for {len(micros)} PPO micro-batches")
            for micro, unsup_micro in zip(micros, unsup_micros):
                s = trainer.train_rlhf(micro)
                if unsup_micro is not None:
                    s["unsup_loss"] = trainer.train_unsupervised(unsup_micro)
                trainer.after_actor_updates()
                stats.append(s)
    return {f"ppo/{key}": all_reduce_mean(torch.stack([s[key] for s in stats]).mean()).item() for key in stats[0]}


def train_step3(args) -> None:
    """Step 3 from validated flags: data, engines, the resumable PPO / critic-free loop
    (rollout, experience, --ppo_epochs updates, metrics, checkpoints, profiling), the final save."""
    device = init_distributed(args.local_rank)
    world = get_world_size()
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.actor_model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    reward_fns = reward_functions(args)
    # with reward functions the prompt rows carry their other columns (e.g. "answer") to them
    prompt_data, _ = create_prompt_dataset(args.local_rank, args.data_path, args.data_split,
                                           args.data_output_path, 3, args.seed, tokenizer, args.max_prompt_seq_len,
                                           chat_template=args.chat_template, row_fields=bool(reward_fns))
    eot = end_of_conversation_text(tokenizer, args.eot_token if args.add_eot_token else None)
    chat = ChatFormat(tokenizer, args.chat_template, eot, args.stop_strings)
    print_rank_0(f"step 3: conversations as {chat.describe()}; "
                 f"generation stops at token ids {list(chat.stop_token_ids)}")
    # --per_device_generation_batch_size counts answers: each prompt is answered n times
    prompts_per_batch = args.per_device_generation_batch_size // args.n_samples_per_prompt
    prompt_loader = make_loader(prompt_data, prompts_per_batch,
                                DataCollatorRLHF(args.max_prompt_seq_len, tokenizer.pad_token_id),
                                shuffle=True, seed=args.seed, drop_last=True)
    unsup_loader = None
    if args.unsupervised_dataset_name:
        unsup_data = create_unsupervised_dataset([args.unsupervised_dataset_name],
                                                 args.unsupervised_dataset_config_name, tokenizer,
                                                 args.max_prompt_seq_len + args.max_answer_seq_len,
                                                 args.data_output_path, args.seed, args.local_rank)
        # whole batches only: each is cut into as many micro-batches as a generation batch
        unsup_loader = make_loader(unsup_data, args.per_device_generation_batch_size, shuffle=True, seed=args.seed,
                                   drop_last=True)
    if len(prompt_loader) == 0:
        _problems([f"{len(prompt_data)} prompts fit --max_prompt_seq_len, fewer than one batch of "
                        f"{prompts_per_batch} prompts (--per_device_generation_batch_size "
                        f"{args.per_device_generation_batch_size} / --n_samples_per_prompt "
                        f"{args.n_samples_per_prompt}) on each of {world} ranks"])
    if unsup_loader is not None and len(unsup_loader) == 0:
        _problems([f"{len(unsup_data)} rows of --unsupervised_dataset_name, fewer than one batch of "
                        f"--per_device_generation_batch_size {args.per_device_generation_batch_size} "
                        f"on each of {world} ranks"])
    steps_per_epoch = len(prompt_loader)
    total_steps = steps_per_epoch * args.num_train_epochs
    for cap in (args.max_steps, args.test_stop_step if args.enable_test_mode else 0):
        if cap:
            total_steps = min(total_steps, cap)
    # the LR schedules' length: the optimizer steps this run takes (the actor's accumulation
    # is doubled with ptx, so it steps as often as the critic)
    num_total_iters = ppo_optimizer_steps(
        total_steps, generation_batches=args.generation_batches,
        generation_batch_size=args.per_device_generation_batch_size,
        training_batch_size=args.per_device_training_batch_size, ppo_epochs=args.ppo_epochs,
        gradient_accumulation_steps=args.gradient_accumulation_steps)
    print_rank_0(f"LR schedules over {num_total_iters} optimizer steps; actor dropout {args.actor_dropout}, "
                 f"critic dropout {args.critic_dropout}")

    engines = build_rlhf_engines(args, tokenizer, num_total_iters)
    trainer = PPOTrainer(engines, tokenizer, ppo_config(args), chat=chat, reward_fns=reward_fns)
    run_config = resolved_config(args, actor_ds_config=engines.actor_ds_config,
                                 critic_ds_config=engines.critic_ds_config, world_size=world,
                                 prompts=len(prompt_data))
    print_rank_0("resolved configuration:\n" + json.dumps(run_config, indent=1, sort_keys=True, default=str))

    sampling_rng = getattr(engines.hybrid, "_generator", None)
    ckpt = Checkpointer(args.output_dir, args.save_interval, args.keep_last,
                        engines={"actor": engines.actor,
                                 **({"critic": engines.critic} if engines.critic is not None else {})},
                        modules={"ema": engines.ema.module} if engines.ema is not None else {},
                        generators={"hybrid": sampling_rng} if sampling_rng is not None else {})
    guard = NonFiniteGuard(args.max_nonfinite_in_a_row, device)
    resumed = ckpt.resume_or_start(args.resume, run_config, guard)
    step, start_epoch, batches_done = resumed.position if resumed else (0, 0, 0)
    unsup_done = resumed.state["unsup_in_epoch"] if resumed else 0
    if resumed:
        engines.hybrid.mark_weights_updated()  # the replica must be refilled from the loaded shards
        trainer.kl_ctl.value = resumed.state.get("kl_coef", trainer.kl_ctl.value)

    def update_guard(name, loss, engine) -> bool:
        """Skip (on every rank) an actor/critic update whose loss is not finite anywhere."""
        if guard.ok(name, step, loss):
            return True
        abandon_accumulation(engine)
        return False

    trainer.update_guard = update_guard
    metrics = metrics_logger_for(args, run_config)
    if args.dump_generations and get_rank() == 0 and resumed is None:
        os.makedirs(os.path.dirname(os.path.abspath(args.dump_generations)), exist_ok=True)
        open(args.dump_generations, "w").close()

    def save():
        return ckpt.save(step, {"epoch": epoch, "batches_in_epoch": batches_done, "unsup_in_epoch": unsup_done,
                                "nonfinite": guard.state(), "config": run_config, "kl_coef": trainer.kl_ctl.value})

    profiler = StepProfiler(args.profile_step, args.profile_dir or os.path.join(args.output_dir, "profile"),
                            get_rank(), device)
    buffer, unsup_buffer = [], []

    def timed_round() -> tuple[dict, float]:
        """The PPO round over the buffered experience, and its seconds."""
        start = time.time()
        return ppo_round(trainer, buffer, unsup_buffer, args), time.time() - start

    progress = tqdm(total=total_steps, initial=step, desc=f"step 3 ({args.algorithm})", disable=get_rank() != 0)
    epoch = start_epoch
    for epoch in range(start_epoch, args.num_train_epochs):
        if step >= total_steps:
            break
        prompt_loader.sampler.set_epoch(epoch)
        if epoch != start_epoch:
            batches_done, unsup_done = 0, 0
        unsup_iter = None
        if unsup_loader is not None:  # the same order as an uninterrupted run: rest of a pass, then cycles
            unsup_iter = chain(skip_batches(unsup_loader, unsup_done % len(unsup_loader)), cycle(unsup_loader)) \
                if unsup_done % len(unsup_loader) else cycle(unsup_loader)
        batches = iter(skip_batches(prompt_loader, batches_done))
        ckpt.restore_rng(resumed)  # once, where the interrupted run stood
        for batch in batches:
            if step >= total_steps:
                break
            if not buffer:
                # a PPO round (--generation_batches rollouts, then training) is one metrics row: its
                # seconds, samples and phases (time/<phase>_s, memory/<phase>_peak_gib) span the round
                round_start, round_samples, round_timings, round_rollouts = time.time(), 0, {}, []
                trainer.phases.reset()
            profiler.begin(step + 1)
            batch = to_device(batch, device)
            fields = {"fields": batch["fields"]} if "fields" in batch else {}
            filter_stats = None
            if args.filter_groups:
                exp, timings = trainer.rollout(batch["prompt"], batch["prompt_att_mask"], **fields)

                def more():
                    """The next batch's rollout for the refill (its prompts count as consumed)."""
                    nonlocal batches_done
                    extra = to_device(next(batches), device)   # StopIteration ends the refill
                    batches_done += 1
                    kw = {"fields": extra["fields"]} if "fields" in extra else {}
                    out, extra_timings = trainer.rollout(extra["prompt"], extra["prompt_att_mask"], **kw)
                    for k, v in extra_timings.items():
                        timings[k] = timings.get(k, 0.0) + v
                    return out

                exp, filter_stats = trainer.fill_groups(exp, more, prompts_per_batch, args.filter_groups_max_extra)
                if exp is not None:
                    trainer.compute_advantages(exp)
            else:
                exp, timings = trainer.generate_experience(batch["prompt"], batch["prompt_att_mask"], **fields)
            step += 1
            batches_done += 1
            progress.update(1)
            if exp is None:
                print_rank_0(f"step {step}: a rank generated no answer longer than one token; batch skipped")
            elif not guard.ok("reward", step, *(t for t in (exp.rewards, exp.values, exp.logprobs, exp.ref_logprobs)
                                                 if t is not None)):
                metrics.log(step, {"train/skipped_nonfinite": guard.skipped})
            else:
                buffer.append(exp)
                round_samples += exp.batch_size
                for k, v in timings.items():
                    round_timings[k] = round_timings.get(k, 0.0) + v
                if unsup_iter is not None:
                    unsup_buffer.append(to_device(next(unsup_iter), device))
                    unsup_done += 1
                # --score_in_training_forward: the advantages come from training, so it runs first
                trained = timed_round() if args.score_in_training_forward else None
                round_rollouts.append((trainer.rollout_metrics(exp), exp.batch_size))
                record = {**merge_rollout_metrics([m for m, _ in round_rollouts], [n for _, n in round_rollouts]),
                          **{f"time/{k}": v for k, v in round_timings.items()}}
                if filter_stats is not None:
                    record.update({f"filter/{k}": int(all_reduce_sum(torch.tensor(float(v))).item())
                                   for k, v in filter_stats.items() if k != "groups_kept"})
                    record["filter/groups_kept_per_rank"] = filter_stats["groups_kept"]
                if args.dump_generations:
                    dump_generations(args.dump_generations, step, exp, tokenizer, get_rank())
                if args.print_answers and step % args.print_answers_interval == 0 and get_rank() == 0:
                    P = exp.prompt_width
                    print(f"--- step {step} prompt: {tokenizer.decode(exp.seq[0, :P], skip_special_tokens=True)!r}\n"
                          f"    answer: {tokenizer.decode(exp.seq[0, P:], skip_special_tokens=True)!r}"
                          f" reward {float(exp.rewards[0]):.3f}", flush=True)
                if len(buffer) >= args.generation_batches:
                    round_stats, train_s = trained or timed_round()
                    record.update(round_stats)
                    buffer, unsup_buffer = [], []
                    record["time/train_s"] = train_s
                    record.update(trainer.phases.metrics())
                    record.update(engines.hybrid.pop_stats())
                    record.update(get_scheduler().pop_stats())
                    record["time/step_s"] = time.time() - round_start
                    record["memory/peak_gib"] = peak_memory_gib(device)
                    record["memory/host_peak_gib"] = host_peak_gib()
                    record.update(allocator_metrics(device))
                    record["zero/params_left_gathered"] = trainer.params_left_gathered()
                    record["ppo/samples_per_s"] = round_samples * world / record["time/step_s"]
                    trainer.update_kl(record["ppo/kl_per_answer"], round_samples * world)
                    record["train/skipped_nonfinite"] = guard.skipped
                    metrics.log(step, record)
                    progress.set_postfix(reward=f"{record['ppo/reward_mean']:.3f}", kl=f"{record['ppo/kl']:.3f}")
            written = profiler.end(step)
            if written:
                print_rank_0(f"profile of step {step} written to {written} (and .trace.json)")
                if profiler.snapshot:
                    print_rank_0(f"memory snapshot of step {step} written to {profiler.snapshot} "
                                 "(view it at https://pytorch.org/memory_viz)")
            if not buffer:  # checkpoints only between PPO rounds: the experience buffer is not saved
                fault_point("step", step)
                if ckpt.due(step):
                    save()
            guard.check_halt(step, save)  # (a halt with experience buffered drops that experience)
    progress.close()

    def write_models():
        save_hf_format(engines.actor, tokenizer, os.path.join(args.output_dir, "actor"), rank=get_rank())
        if engines.critic is not None:  # critic-free algorithms have no critic to save
            save_reward_model(engines.critic, tokenizer, os.path.join(args.output_dir, "critic"), rank=get_rank())
        if engines.ema is not None:
            save_hf_format(engines.ema, tokenizer, os.path.join(args.output_dir, "actor_ema"), rank=get_rank())

    if not args.skip_final_save:
        ckpt.save_final(write_models, save, args.output_dir, final_save_host_bytes(
            *(e for e in (engines.actor, engines.critic, engines.ema) if e is not None)))
        print_rank_0(f"saved actor/{' and critic/' if engines.critic is not None else ''} to {args.output_dir}")
    if get_rank() == 0:
        save_json(run_config, os.path.join(args.output_dir, "training_config.json"))
    metrics.close()
