"""The resumable epoch loop shared by step 1 (SFT), step 2 (reward model) and step 2 DPO.

Each entry point supplies what differs - one optimizer step (`train_step`) and its
evaluation (`run_eval`) - and this loop does the rest the same way for all three: epochs
from the resumed position (batches already consumed are skipped, the RNG restored where the
interrupted run stood), the progress bar and per-step record, evaluation every
`eval_interval` steps and at the end of each epoch, checkpoints every `--save_interval`, the
non-finite guard's halt, and at the end the final save (`Checkpointer.save_final`) and
training_config.json with the last evaluation.

`load_step_data` and `start_run` are the set-up the three entry points share: the step's
rows and rank-sharded loaders with the number of optimizer steps the run takes, then the
resolved configuration, checkpointer, non-finite guard, resume point and metrics.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tqdm import tqdm

from dschat.data import create_prompt_dataset
from dschat.engine.train_utils import log_train_step, make_loader, micro_batch_groups
from dschat.engine.zero import final_save_host_bytes
from dschat.utils.checkpoint import Checkpointer, NonFiniteGuard, Resumed, fault_point, skip_batches
from dschat.utils.dist import get_rank, get_world_size
from dschat.utils.logging import print_rank_0
from dschat.utils.metrics import metrics_logger_for
from dschat.utils.run import resolved_config, save_json

# (micro-batches of one optimizer step, its 1-based step number) -> (loss or None when the
# update was skipped, extra metrics of the step to log or None)
TrainStep = Callable[[list, int], tuple[Optional[float], Optional[dict]]]
# (step, the epoch that just ended or None) -> the evaluation's results (logged by the callee)
RunEval = Callable[[int, Optional[int]], dict]


@dataclass
class LoopState:
    """Where the loop stands: what a checkpoint records to resume from."""
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0


def train_epochs(*, desc: str, engine, loader, ckpt: Checkpointer, resumed: Optional[Resumed],
                 guard: NonFiniteGuard, metrics, device, run_config: dict, total_steps: int,
                 num_epochs: int, accumulation: int, eval_interval: int, print_loss: bool,
                 train_step: TrainStep, run_eval: RunEval) -> tuple[dict, Callable[[], object]]:
    """Train to `total_steps` (or the end of `num_epochs`); returns (the last evaluation's
    results, `save`: a checkpoint of the current state, for `finish`). A fresh run is
    evaluated before its first step; a run resumed after its last step is evaluated once."""
    step, epoch, batches = resumed.position if resumed else (0, 0, 0)
    state = LoopState(step, epoch, batches)

    def save():
        return ckpt.save(state.step, {"epoch": state.epoch, "batches_in_epoch": state.batches_in_epoch,
                                      "nonfinite": guard.state(), "config": run_config})

    result = run_eval(0, None) if resumed is None else None
    progress = tqdm(total=total_steps, initial=state.step, desc=desc, disable=get_rank() != 0)
    start_epoch = state.epoch
    for epoch in range(start_epoch, num_epochs):
        if state.step >= total_steps:
            break
        state.epoch = epoch
        loader.sampler.set_epoch(epoch)
        state.batches_in_epoch = state.batches_in_epoch if epoch == start_epoch else 0
        groups = micro_batch_groups(skip_batches(loader, state.batches_in_epoch), accumulation)
        ckpt.restore_rng(resumed)  # once, where the interrupted run stood
        for group in groups:
            if state.step >= total_steps:
                break
            start = time.time()
            loss, extra = train_step(group, state.step + 1)
            state.step += 1
            state.batches_in_epoch += len(group)
            progress.update(1)
            log_train_step(metrics, progress, engine, step=state.step, epoch=epoch, seconds=time.time() - start,
                           device=device, loss=loss, skipped=guard.skipped, print_loss=print_loss)
            if extra:
                metrics.log(state.step, extra)
            if eval_interval and state.step % eval_interval == 0:
                result = run_eval(state.step, None)
            fault_point("step", state.step)
            if ckpt.due(state.step):
                save()
            guard.check_halt(state.step, save)
        result = run_eval(state.step, epoch)
    progress.close()
    if result is None:  # resumed after the last step: nothing was left to train
        result = run_eval(state.step, None)
    return result, save


def finish(ckpt: Checkpointer, write_model: Callable[[], None], save: Callable[[], object], output_dir: str,
           run_config: dict, result: dict, metrics, model) -> None:
    """The final model (a failed write, or too little host memory for `model`'s, checkpoints
    the trained state first, see Checkpointer.save_final), then training_config.json with the
    last evaluation."""
    ckpt.save_final(write_model, save, output_dir, final_save_host_bytes(model))
    if get_rank() == 0:
        run_config["final_eval"] = result
        save_json(run_config, f"{output_dir}/training_config.json")
    metrics.close()


@dataclass
class StepData:
    """A step's rows, their rank-sharded loaders and the optimizer steps the run takes."""
    train: object
    eval: object
    train_loader: object
    eval_loader: object
    total_steps: int


def load_step_data(args, tokenizer, phase: int, collator=None, **dataset_kw) -> StepData:
    """Rows of DS-Chat data phase `phase` (1: prompt + chosen answer, 2: chosen/rejected pairs)
    from the data flags; total_steps = epochs x optimizer steps per epoch, capped by --max_steps."""
    train, evaluation = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, phase, args.seed,
        tokenizer, args.max_seq_len, end_of_conversation_token=args.eot_token if args.add_eot_token else None,
        chat_template=args.chat_template, **dataset_kw)
    train_loader = make_loader(train, args.per_device_train_batch_size, collator, shuffle=True, seed=args.seed)
    eval_loader = make_loader(evaluation, args.per_device_eval_batch_size, collator, shuffle=False, seed=args.seed)
    total_steps = -(-len(train_loader) // args.gradient_accumulation_steps) * args.num_train_epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    return StepData(train, evaluation, train_loader, eval_loader, total_steps)


@dataclass
class Run:
    """One entry point's run: its resolved configuration, checkpointer, non-finite guard,
    resume point and metrics; `train` runs `train_epochs` on them, `finish` ends the run."""
    config: dict
    ckpt: Checkpointer
    guard: NonFiniteGuard
    resumed: Optional[Resumed]
    metrics: object

    def train(self, *, desc: str, engine, data: StepData, args, device, train_step: TrainStep,
              run_eval: RunEval) -> tuple[dict, Callable[[], object]]:
        return train_epochs(desc=desc, engine=engine, loader=data.train_loader, ckpt=self.ckpt, resumed=self.resumed,
                            guard=self.guard, metrics=self.metrics, device=device, run_config=self.config,
                            total_steps=data.total_steps, num_epochs=args.num_train_epochs,
                            accumulation=args.gradient_accumulation_steps, eval_interval=args.eval_interval,
                            print_loss=args.print_loss, train_step=train_step, run_eval=run_eval)

    def finish(self, write_model: Callable[[], None], save: Callable[[], object], output_dir: str,
               result: dict, model) -> None:
        """`write_model` writes `model` (its engine) to `output_dir`."""
        finish(self.ckpt, write_model, save, output_dir, self.config, result, self.metrics, model)


def start_run(args, engine, device, **config_extra) -> Run:
    """The resolved configuration (printed on rank 0; `config_extra`: the DeepSpeed config and
    row counts), the checkpointer of `engine`, the guard, the resume point and the metrics."""
    config = resolved_config(args, world_size=get_world_size(), **config_extra)
    print_rank_0("resolved configuration:\n" + json.dumps(config, indent=1, sort_keys=True, default=str))
    ckpt = Checkpointer(args.output_dir, args.save_interval, args.keep_last, engines={"model": engine})
    guard = NonFiniteGuard(args.max_nonfinite_in_a_row, device)
    resumed = ckpt.resume_or_start(args.resume, config, guard)
    return Run(config, ckpt, guard, resumed, metrics_logger_for(args, config))
