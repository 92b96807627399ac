#!/usr/bin/env python
"""Score prompt/answer pairs with a trained reward model (no DeepSpeed needed).

    python training/step2_reward_model_finetuning/rw_eval.py --model_name_or_path output/step2 \
        --prompt "Human: What is 2 plus 3? Assistant:" --answer " Sure! 2 plus 3 is 5." --answer " No."
    python training/step2_reward_model_finetuning/rw_eval.py --model_name_or_path output/step2 --pairs pairs.jsonl

A pairs file is JSONL with `prompt` and `answer` (or `chosen` and `rejected`) per row.
Prompts without the DS-Chat "Human: ... Assistant:" frame are wrapped in it.
"""
import argparse
import json
import sys

import torch

from dschat.models.model_utils import load_tokenizer
from dschat.models.reward_model import load_reward_model
from dschat.utils.errors import UserInputError
from dschat.utils.run import main_guard


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", required=True, help="A reward-model folder (step-2 output).")
    p.add_argument("--prompt", action="append", default=[], help="A prompt (repeat for several).")
    p.add_argument("--answer", action="append", default=[],
                   help="An answer; with one --prompt, every answer is scored against it.")
    p.add_argument("--pairs", type=str, default=None,
                   help="JSONL file of prompt/answer or prompt/chosen/rejected rows.")
    p.add_argument("--max_seq_len", type=int, default=512, help="Longer inputs are truncated.")
    p.add_argument("--add_eot_token", action="store_true", help="End each answer with --eot_token.")
    p.add_argument("--eot_token", type=str, default="<|endoftext|>", help="End-of-turn token.")
    return p.parse_args(argv)


def frame(prompt: str) -> str:
    if "Assistant:" in prompt:
        return prompt
    return f"\n\nHuman: {prompt}\n\nAssistant:"


def read_pairs(args) -> list[tuple[str, str]]:
    pairs = []
    if args.pairs:
        try:
            with open(args.pairs) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if "answer" in row:
                        pairs.append((row["prompt"], row["answer"]))
                    elif "chosen" in row and "rejected" in row:
                        pairs += [(row["prompt"], row["chosen"]), (row["prompt"], row["rejected"])]
                    else:
                        raise UserInputError(f"{args.pairs} row {n}: needs prompt+answer or prompt+chosen+rejected")
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise UserInputError(f"--pairs {args.pairs}: {e}") from None
    if args.prompt:
        if len(args.prompt) == 1:
            pairs += [(args.prompt[0], a) for a in args.answer]
        elif len(args.prompt) == len(args.answer):
            pairs += list(zip(args.prompt, args.answer))
        else:
            raise UserInputError("give one --prompt with any number of --answer, or as many --prompt as --answer")
    if not pairs:
        raise UserInputError("nothing to score: pass --prompt/--answer or --pairs")
    return pairs


@torch.no_grad()
def score(model, tokenizer, pairs, max_seq_len: int, eot: str) -> list[float]:
    scores = []
    for prompt, answer in pairs:
        text = frame(prompt) + answer + eot
        enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_seq_len)
        out = model.forward_value(enc["input_ids"], enc["attention_mask"])
        scores.append(float(out["chosen_end_scores"][0]))
    return scores


def main(argv=None):
    args = parse_args(argv)
    pairs = read_pairs(args)
    tokenizer = load_tokenizer(args.model_name_or_path)
    model = load_reward_model(args.model_name_or_path, tokenizer, flag="--model_name_or_path").eval()
    eot = args.eot_token if args.add_eot_token else tokenizer.eos_token
    for (prompt, answer), s in zip(pairs, score(model, tokenizer, pairs, args.max_seq_len, eot)):
        print(json.dumps({"prompt": prompt, "answer": answer, "score": round(s, 4)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main_guard(main)
