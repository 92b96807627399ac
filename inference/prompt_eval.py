#!/usr/bin/env python
"""Baseline vs finetuned answers side by side, with reward scores when a reward model is given.

    python inference/prompt_eval.py --model_name_or_path_baseline output/demo/step1 \\
        --model_name_or_path_finetune output/demo/step3/actor --reward_model output/demo/step2
    python inference/prompt_eval.py --finetune out/step3/actor --prompts my_prompts.txt --jsonl answers.jsonl

Prompts: --prompts FILE (one prompt per line, or JSONL with a `prompt` field and an
optional `reference`/`chosen` answer), else held-out prompts of --data_path (default: the
bundled demo data): the eval rows of step 3's share under --data_split/--seed, which no
step trains on. Prompts are framed as "\\n\\nHuman: ...\\n\\nAssistant:" unless they
already are, then rendered with the tokenizer's chat template when it has one
(--chat_template). Decoding is greedy unless --temperature/--top_p/--top_k is given;
answers end as step 3's do (eos, the template's end of turn, or before a stop string).
Runs in one process, no DeepSpeed (a GPU if there is one).
"""
import argparse
import json
import sys
from pathlib import Path

from dschat.data.assets import BUNDLED_DATASET_NAME
from dschat.utils.errors import UserInputError
from dschat.utils.run import main_guard
from inference.common import (
    Sampling,
    answer_logprobs,
    chat_format,
    generate_answers,
    heldout_prompts,
    load_causal_lm,
    load_reward,
    pick_device,
    pick_dtype,
    read_prompts,
    reward_scores,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path_baseline", "--baseline", dest="baseline", default=None,
                   help="The model before training (e.g. the step-1 output, or a hub name).")
    p.add_argument("--model_name_or_path_finetune", "--finetune", dest="finetune", default=None,
                   help="The trained model (e.g. step-3 actor/).")
    p.add_argument("--reward_model", default=None, help="A step-2 output folder: score every answer with it.")
    p.add_argument("--judge_model", default=None,
                   help="A second reward model (one the policy never trained against): score every answer "
                        "with it too, and report win rates under both.")
    p.add_argument("--kl_samples", type=int, default=0,
                   help="Sample this many answers per prompt from the finetuned model (temperature 1) and "
                        "report KL(finetune || baseline) per answer: the mean over them of the summed "
                        "log-ratio of their tokens. Both models are held in memory for it.")
    p.add_argument("--prompts", default=None, help="Prompt file: one per line, or JSONL with `prompt`.")
    p.add_argument("--data_path", nargs="*", default=[BUNDLED_DATASET_NAME],
                   help="Without --prompts: take held-out prompts of this data (default: the bundled demo data).")
    p.add_argument("--data_split", default="6,3,1", help="Without --prompts: the split the run used.")
    p.add_argument("--seed", type=int, default=1234, help="Data split seed (and sampling seed).")
    p.add_argument("--num_prompts", type=int, default=16, help="Use at most this many prompts.")
    p.add_argument("--max_new_tokens", type=int, default=128, help="Answer tokens at most.")
    p.add_argument("--max_prompt_len", type=int, default=256, help="Longer prompts keep their last tokens.")
    p.add_argument("--temperature", type=float, default=None, help="Sample at this temperature (default: greedy).")
    p.add_argument("--top_p", type=float, default=None, help="Nucleus sampling.")
    p.add_argument("--top_k", type=int, default=None, help="Top-k sampling.")
    p.add_argument("--batch_size", type=int, default=16, help="Prompts per generate call.")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda:0 if present, else cpu).")
    p.add_argument("--dtype", default=None, choices=("fp32", "fp16", "bf16"),
                   help="Model precision (default: bf16 on GPU, fp32 on CPU).")
    p.add_argument("--chat_template", default="auto", choices=("auto", "none"),
                   help="auto: prompts in the tokenizer's chat template when it has one (as steps 1-3 "
                        "train with --chat_template auto); none: DS-Chat's raw Human:/Assistant: text.")
    p.add_argument("--stop_strings", nargs="*", default=None,
                   help="Without a chat template, answers end before these (default: '\\n\\nHuman:').")
    p.add_argument("--jsonl", default=None, help="Also write one JSON row per prompt here.")
    p.add_argument("--summary_json", default=None, help="Write the mean rewards etc. here (JSON).")
    p.add_argument("--width", type=int, default=44, help="Column width of the printed table.")
    p.add_argument("--quiet", action="store_true", help="Print only the summary, not the table.")
    return p.parse_args(argv)


def validate(args) -> None:
    problems = []
    if not args.baseline and not args.finetune:
        problems.append("give --model_name_or_path_baseline and/or --model_name_or_path_finetune")
    for flag in ("num_prompts", "max_new_tokens", "max_prompt_len", "batch_size", "width"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.kl_samples < 0:
        problems.append(f"--kl_samples must be >= 0, got {args.kl_samples}")
    if args.kl_samples and not (args.baseline and args.finetune):
        problems.append("--kl_samples needs both --model_name_or_path_baseline and --model_name_or_path_finetune")
    if problems:
        raise UserInputError("; ".join(problems))


def load_rows(args) -> list[dict]:
    if args.prompts:
        return read_prompts(args.prompts)[:args.num_prompts]
    rows = heldout_prompts(args.data_path, args.data_split, args.seed, args.num_prompts)
    if not rows:
        raise UserInputError(f"--data_path {args.data_path}: no held-out prompts under --data_split {args.data_split}")
    return rows


def answer_all(args, rows, device, dtype) -> dict:
    """{column name: [(prompt_ids, answer_ids, text), ...]} for the baseline and the finetuned model.
    Models are loaded one at a time, so two large models need not fit together."""
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    prompts = [r["prompt"] for r in rows]
    answers = {}
    for name, path, flag in (("baseline", args.baseline, "--model_name_or_path_baseline"),
                             ("finetune", args.finetune, "--model_name_or_path_finetune")):
        if not path:
            continue
        model, tokenizer = load_causal_lm(path, device, dtype, flag=flag)
        answers[name] = generate_answers(model, tokenizer, prompts, sampling, batch_size=args.batch_size,
                                         max_prompt_len=args.max_prompt_len, seed=args.seed,
                                         chat=chat_format(tokenizer, args.chat_template, args.stop_strings))
        answers[name + "_tokenizer"] = tokenizer
        del model
    return answers


SCORERS = (("reward", "reward_model"), ("judge", "judge_model"))


def score_all(args, answers, device, dtype) -> dict:
    """{scorer: {column name: [reward, ...]}} for --reward_model ("reward") and --judge_model ("judge")."""
    scores = {}
    for scorer, flag in SCORERS:
        path = getattr(args, flag)
        if not path:
            continue
        model, rm_tokenizer = load_reward(path, device, dtype, flag=f"--{flag}")
        scores[scorer] = {}
        for name in ("baseline", "finetune"):
            if name not in answers:
                continue
            tok = answers[name + "_tokenizer"]
            if tok.get_vocab() != rm_tokenizer.get_vocab():
                raise UserInputError(f"--{flag} {path} uses another tokenizer than the {name} "
                                     "model; step 3 needs actor and reward model to share one")
            scores[scorer][name] = reward_scores(model, [(p, a) for p, a, _ in answers[name]],
                                                 rm_tokenizer.pad_token_id, batch_size=args.batch_size)
        del model
    return scores


def sampled_kl(args, rows, device, dtype) -> dict:
    """KL(finetune || baseline) per answer, estimated on --kl_samples answers per prompt
    sampled from the finetuned model at temperature 1: the mean of sum_t log p_ft(y_t) -
    log p_base(y_t) over the answers' tokens (the k1 estimator, unbiased for the sequence KL).
    Greedy answers would not do: their log-ratio is not a KL estimate."""
    finetune, tokenizer = load_causal_lm(args.finetune, device, dtype, flag="--model_name_or_path_finetune")
    baseline, _ = load_causal_lm(args.baseline, device, dtype, flag="--model_name_or_path_baseline")
    chat = chat_format(tokenizer, args.chat_template, args.stop_strings)
    prompts = [r["prompt"] for r in rows for _ in range(args.kl_samples)]
    sampled = generate_answers(finetune, tokenizer, prompts, Sampling(args.max_new_tokens, temperature=1.0),
                               batch_size=args.batch_size, max_prompt_len=args.max_prompt_len,
                               seed=args.seed, chat=chat)
    pairs = [(p, a) for p, a, _ in sampled]
    ft = answer_logprobs(finetune, pairs, tokenizer.pad_token_id, batch_size=args.batch_size)
    base = answer_logprobs(baseline, pairs, tokenizer.pad_token_id, batch_size=args.batch_size)
    per_answer = [f - b for f, b in zip(ft, base)]
    tokens = sum(len(a) for _, a in pairs)
    return {"kl_per_answer": sum(per_answer) / len(per_answer),
            "kl_per_token": sum(per_answer) / max(tokens, 1),
            "kl_samples": len(per_answer), "kl_sampled_answer_tokens_mean": tokens / len(per_answer)}


def clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "~"


def table(rows, answers, scores, width: int) -> str:
    """A fixed-width table: prompt | baseline answer (rewards) | finetuned answer (rewards)."""
    header = ["#", "prompt"]
    cols = [c for c in ("baseline", "finetune") if c in answers]
    for c in cols:
        header += [c] + [scorer for scorer in scores if c in scores[scorer]]
    lines = []
    for i, row in enumerate(rows):
        cells = [str(i), clip(row["prompt"].replace("Human:", "").replace("Assistant:", ""), width)]
        for c in cols:
            cells.append(clip(answers[c][i][2], width))
            cells += [f"{scores[scorer][c][i]:+.3f}" for scorer in scores if c in scores[scorer]]
        lines.append(cells)
    widths = [max(len(r[j]) for r in [header] + lines) for j in range(len(header))]
    fmt = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), sep] + [fmt(r) for r in lines])


def distinct_n(answers: list[list[int]], n: int = 2) -> float:
    """Distinct-n (Li et al. 2016): distinct token n-grams over all n-grams of all answers."""
    grams = [tuple(a[i:i + n]) for a in answers for i in range(len(a) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def ended(answer: list[int], chat, max_new_tokens: int) -> bool:
    """The answer stopped on its own (end of turn, eos or a stop string), not at the length limit:
    generation only stops a row early at a stop, so a shorter answer ended there."""
    return len(answer) < max_new_tokens or (bool(answer) and answer[-1] in chat.stop_token_ids)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5


def summarize(rows, answers, scores, chat=None, max_new_tokens: int | None = None) -> dict:
    """Per model: answer length, distinct-2, share of answers that ended on their own, and the
    mean/std reward under each scorer; per scorer: finetune-vs-baseline wins and gain. Keys of
    the policy reward model: `{col}_reward_mean`, `finetune_better`, `reward_gain`; of the
    judge: `{col}_judge_mean`, `judge_finetune_better`, `judge_gain` ..."""
    out = {"num_prompts": len(rows), "sources": sorted({r.get("source", "file") for r in rows})}
    for c in ("baseline", "finetune"):
        if c not in answers:
            continue
        ids = [a for _, a, _ in answers[c]]
        out[f"{c}_answer_tokens_mean"] = sum(len(a) for a in ids) / max(len(rows), 1)
        out[f"{c}_distinct_2"] = distinct_n(ids, 2)
        if chat is not None and max_new_tokens:
            out[f"{c}_ended_share"] = sum(ended(a, chat, max_new_tokens) for a in ids) / max(len(ids), 1)
    for scorer, per_col in scores.items():
        for c, xs in per_col.items():
            out[f"{c}_{scorer}_mean"], out[f"{c}_{scorer}_std"] = _mean_std(xs)
        if "baseline" in per_col and "finetune" in per_col:
            pairs = list(zip(per_col["baseline"], per_col["finetune"]))
            prefix = "" if scorer == "reward" else f"{scorer}_"
            better, worse = sum(f > b for b, f in pairs), sum(f < b for b, f in pairs)
            out[f"{prefix}finetune_better"], out[f"{prefix}finetune_worse"] = better, worse
            out[f"{prefix}win_rate"] = (better + 0.5 * (len(pairs) - better - worse)) / len(pairs)
            gain = out[f"finetune_{scorer}_mean"] - out[f"baseline_{scorer}_mean"]
            out[f"{scorer}_gain"] = gain
            std = out[f"baseline_{scorer}_std"]
            out[f"{scorer}_gain_in_baseline_std"] = gain / std if std > 0 else None
    return out


def write_jsonl(path, rows, answers, scores) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            record = dict(row)
            for c in ("baseline", "finetune"):
                if c in answers:
                    record[c] = answers[c][i][2]
                    record[f"{c}_tokens"] = len(answers[c][i][1])
                for scorer, per_col in scores.items():
                    if c in per_col:
                        record[f"{c}_{scorer}"] = per_col[c][i]
            f.write(json.dumps(record) + "\n")


def main(argv=None):
    args = parse_args(argv)
    validate(args)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    rows = load_rows(args)
    answers = answer_all(args, rows, device, dtype)
    scores = score_all(args, answers, device, dtype)
    tokenizer = answers.get("finetune_tokenizer") or answers["baseline_tokenizer"]
    summary = summarize(rows, answers, scores, chat_format(tokenizer, args.chat_template, args.stop_strings),
                        args.max_new_tokens)
    if args.kl_samples:
        summary.update(sampled_kl(args, rows, device, dtype))
    if not args.quiet:
        print(table(rows, answers, scores, args.width))
    print(json.dumps(summary))
    if args.jsonl:
        write_jsonl(args.jsonl, rows, answers, scores)
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main_guard(main)
