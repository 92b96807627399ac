"""Multi-step integer word problems with step-by-step solutions in GSM8K's answer format.

    python -m dschat.tasks.arithmetic make --out data/arith --train 5000 --eval 500 --difficulty 3 --seed 1
    python -m dschat.tasks.arithmetic eval --model output/step3/actor --data data/arith/eval.jsonl

A problem is a short story (someone's items bought, lost, multiplied, shared) of
`difficulty` operations on a running integer total; its solution shows one line per
operation and ends with "#### N". `make` writes DIR/train.jsonl and DIR/eval.jsonl, rows of
DS-Chat's prompt/chosen/rejected form (so ``--data_path DIR`` loads them as train/eval
splits for steps 1-3) plus the reference ``answer``: the prompt is
"\\n\\nHuman: <question> Put the final answer after ####.\\n\\nAssistant:", chosen the
reference solution, rejected the same solution with a slip in its last step.

Train and eval never share a question: each side draws from its own seeded stream and
keeps only questions whose hash falls on its side (so sets made with other sizes or
seeds stay disjoint too), and the text sets are checked against each other.
`exact_match_reward` is the step-3 reward (``--reward_fn
dschat.tasks.arithmetic:exact_match_reward``); `eval` decodes greedily and reports the
exact-match accuracy with the same check.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Optional, Sequence

from dschat.data.formats import as_answer, as_prompt
from dschat.utils.errors import UserInputError

INSTRUCTION = "Put the final answer after ####."
MAX_DIFFICULTY = 8
VALUE_LIMIT = 5000      # running totals stay human-sized: no multiplying past this
EVAL_SHARE = 5          # one question hash in 5 belongs to the eval side

# (name, subject, object, possessive, reflexive)
PEOPLE = (("Maya", "she", "her", "her", "herself"), ("Liam", "he", "him", "his", "himself"),
          ("Ana", "she", "her", "her", "herself"), ("Omar", "he", "him", "his", "himself"),
          ("Priya", "she", "her", "her", "herself"), ("Jonas", "he", "him", "his", "himself"),
          ("Keiko", "she", "her", "her", "herself"), ("Tomas", "he", "him", "his", "himself"),
          ("Lena", "she", "her", "her", "herself"), ("Kwame", "he", "him", "his", "himself"))
ITEMS = (("marble", "marbles"), ("apple", "apples"), ("sticker", "stickers"), ("coin", "coins"),
         ("cookie", "cookies"), ("book", "books"), ("pencil", "pencils"), ("shell", "shells"),
         ("card", "cards"), ("stamp", "stamps"))
CONTAINERS = ("bags", "boxes", "packs", "jars")
CONNECTORS = ("Then", "After that,", "Later,", "Next,")

STARTS = ("{name} has {n}.", "{name} starts the day with {n}.", "{name} keeps {n} in a drawer.")
QUESTIONS = ("How many {items} does {name} have now?", "How many {items} does {name} have at the end?")
TEMPLATES = {
    "add": ("{sub} buys {k} more {items_k}.", "A friend gives {obj} {k} more {items_k}.",
            "{sub} finds {k} more {items_k}."),
    "sub": ("{sub} loses {k} {items_k}.", "{sub} gives {k} {items_k} to a neighbour.",
            "{sub} sells {k} {items_k}."),
    "mul": ("{sub} gets enough new {items} to have {times} as many as before.",
            "By the end of the week, {poss} pile of {items} is {times} as big."),
    "div": ("{sub} splits {poss} {items} into {k} equal piles and keeps only one pile.",
            "{sub} shares {poss} {items} equally among {k} children, {refl} included, and keeps "
            "{poss} own share."),
    "packs": ("{sub} buys {a} {box} with {b} {items} in each.", "{sub} receives {a} {box} of {b} {items} each."),
}

Step = tuple[str, tuple[int, ...]]  # ("add" | "sub" | "mul" | "div" | "packs", operands)


# ---------------------------------------------------------------------------- answers

_ANSWER = re.compile(r"####[\s$*]*(-?(?:\d{1,3}(?:[, ]\d{3})+|\d+)(?:\.\d+)?)")


def extract_answer(text: str) -> Optional[str]:
    """The number after the last "####" in `text` as a plain string ("1,234." -> "1234"),
    or None when there is no "####" or no number right after the last one. Spaces, "$"
    and "*" between the marks and the number are skipped; commas or spaces between digit
    groups of three are dropped; a trailing period is not part of the number."""
    at = text.rfind("####")
    if at < 0:
        return None
    match = _ANSWER.match(text, at)
    return re.sub(r"[, ]", "", match.group(1)) if match else None


def _value(text) -> Optional[Decimal]:
    try:
        return Decimal(str(text).strip())
    except (InvalidOperation, ValueError):
        return None


def is_correct(completion: str, reference) -> bool:
    """Whether the number after the completion's last "####" equals `reference`
    numerically ("12.0" equals 12)."""
    got, want = _value(extract_answer(completion)), _value(reference)
    return got is not None and want is not None and got == want


def exact_match_reward(prompts: Sequence[str], answers: Sequence[str], answer: Optional[Sequence] = None,
                       chosen: Optional[Sequence[str]] = None, **fields) -> list[float]:
    """A `--reward_fn`: 1.0 where an answer's number after "####" equals the reference, else 0.

    The reference is the row's ``answer`` field, or else the number after "####" in its
    ``chosen`` solution. Other dataset fields are ignored.
    """
    refs = answer if answer is not None else (
        [extract_answer(c) if c is not None else None for c in chosen] if chosen is not None else None)
    if refs is None:
        raise ValueError("exact_match_reward needs an 'answer' (or 'chosen') field in the dataset rows")
    for i, ref in enumerate(refs):
        if _value(ref) is None:
            raise ValueError(f"reference answer {ref!r} is not a number (row {i})")
    return [1.0 if is_correct(a, ref) else 0.0 for a, ref in zip(answers, refs)]


# ---------------------------------------------------------------------------- problems

@dataclass(frozen=True)
class Problem:
    """One word problem. `solution` ends with "#### <answer>"; `rejected` is the same
    solution with a slip in its last step; `start` and `steps` recompute the answer."""
    question: str
    solution: str
    rejected: str
    answer: int
    start: int
    steps: tuple[Step, ...]

    def row(self) -> dict:
        """A DS-Chat prompt dataset row (prompt/chosen/rejected) plus the answer fields."""
        return {"prompt": as_prompt(f"{self.question} {INSTRUCTION}"), "chosen": as_answer(self.solution),
                "rejected": as_answer(self.rejected), "answer": str(self.answer),
                "difficulty": len(self.steps)}


def apply_step(value: int, step: Step) -> int:
    """The running total after one operation."""
    kind, args = step
    if kind == "add":
        return value + args[0]
    if kind == "sub":
        return value - args[0]
    if kind == "mul":
        return value * args[0]
    if kind == "div":
        if value % args[0]:
            raise ValueError(f"{value} is not divisible by {args[0]}")
        return value // args[0]
    if kind == "packs":
        return value + args[0] * args[1]
    raise ValueError(f"unknown step {kind!r}")


def _pick_step(rng: random.Random, value: int, max_operand: int) -> Step:
    """A random operation that keeps the total a positive integer below VALUE_LIMIT."""
    factor_max = max(2, min(5, max_operand))
    options = [("add", (rng.randint(1, max_operand),)),
               ("packs", (rng.randint(2, factor_max), rng.randint(2, max(2, max_operand // 2))))]
    if value > 1:
        options.append(("sub", (rng.randint(1, min(max_operand, value - 1)),)))
    if value * 2 <= VALUE_LIMIT:
        options.append(("mul", (rng.randint(2, min(factor_max, VALUE_LIMIT // value)),)))
    divisors = [k for k in range(2, factor_max + 1) if value % k == 0]
    if divisors:
        options.append(("div", (rng.choice(divisors),)))
    return rng.choice(options)


def _count(k: int, item: tuple[str, str]) -> str:
    return f"{k} {item[0] if k == 1 else item[1]}"


def _times(k: int) -> str:
    return {2: "twice", 3: "three times"}.get(k, f"{k} times")


def _sentence(rng: random.Random, step: Step, words: dict, first: bool) -> str:
    kind, args = step
    fill = dict(words, k=args[0], items_k=words["item"][0] if args[0] == 1 else words["items"],
                times=_times(args[0]), a=args[0], b=args[-1], box=rng.choice(CONTAINERS))
    text = rng.choice(TEMPLATES[kind]).format(**fill)
    if first:
        return text[0].upper() + text[1:]
    return f"{rng.choice(CONNECTORS)} {text[0].lower() + text[1:]}"  # "Then, by the end of the week, ..."


def _solution_line(step: Step, value: int, result: int, words: dict) -> str:
    """One solution line: what happens, then the computation "a op b = c"."""
    kind, args = step
    sub = words["sub"].capitalize()
    if kind == "add":
        return f"{sub} gets {args[0]} more: {value} + {args[0]} = {result}."
    if kind == "sub":
        return f"{sub} has {args[0]} fewer: {value} - {args[0]} = {result}."
    if kind == "mul":
        return f"{_times(args[0]).capitalize()} as many: {value} * {args[0]} = {result}."
    if kind == "div":
        return f"One of {args[0]} equal shares: {value} / {args[0]} = {result}."
    extra = args[0] * args[1]
    return (f"The new ones hold {args[0]} * {args[1]} = {extra} {words['items']}, so "
            f"{words['sub']} has {value} + {extra} = {result}.")


def make_problem(rng: random.Random, n_ops: int, max_operand: int = 20) -> Problem:
    """A problem of `n_ops` operations with operands up to `max_operand`, drawn from `rng`."""
    name, sub, obj, poss, refl = rng.choice(PEOPLE)
    item = rng.choice(ITEMS)
    words = dict(name=name, sub=sub, obj=obj, poss=poss, refl=refl, item=item, items=item[1])
    start = rng.randint(2, max(2, max_operand))
    sentences = [rng.choice(STARTS).format(name=name, n=_count(start, item))]
    lines = [f"{name} starts with {_count(start, item)}."]
    value, steps = start, []
    for i in range(n_ops):
        step = _pick_step(rng, value, max_operand)
        result = apply_step(value, step)
        sentences.append(_sentence(rng, step, words, first=(i == 0 and rng.random() < 0.5)))
        lines.append(_solution_line(step, value, result, words))
        steps.append(step)
        previous, value = value, result
    sentences.append(rng.choice(QUESTIONS).format(items=item[1], name=name))
    # the rejected answer slips in the last computation and carries the error to "####"
    wrong = value + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if value + d >= 0])
    solution = "\n".join(lines + [f"#### {value}"])
    rejected = "\n".join(lines[:-1] + [_solution_line(steps[-1], previous, wrong, words), f"#### {wrong}"])
    return Problem(" ".join(sentences), solution, rejected, value, start, tuple(steps))


# ---------------------------------------------------------------------------- splits

def side_of(question: str) -> str:
    """"train" or "eval": which set may hold this question text (a fixed hash partition)."""
    digest = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16)
    return "eval" if digest % EVAL_SHARE == 0 else "train"


def parse_difficulty(text, flag: str = "--difficulty") -> tuple[int, int]:
    """"3" -> (3, 3) operations per problem; "1-4" -> (1, 4), a uniform mix."""
    lo, _, hi = str(text).partition("-")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise UserInputError(f"{flag} {text!r}: expected a number of operations such as 3, "
                             "or a range such as 1-4") from None
    if not 1 <= lo <= hi <= MAX_DIFFICULTY:
        raise UserInputError(f"{flag} {text}: operations per problem must be within 1-{MAX_DIFFICULTY}")
    return lo, hi


def generate(n: int, difficulty, seed: int, side: str, max_operand: int = 20,
             exclude: frozenset = frozenset()) -> list[Problem]:
    """`n` distinct problems of one side ("train" / "eval"), deterministic in all arguments."""
    lo, hi = parse_difficulty(difficulty)
    rng = random.Random(f"dschat-arithmetic-{side}-{seed}")  # str seeds hash the same in every process
    seen, out = set(exclude), []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            break
        problem = make_problem(rng, rng.randint(lo, hi), max_operand)
        if problem.question not in seen and side_of(problem.question) == side:
            seen.add(problem.question)
            out.append(problem)
    if len(out) < n:
        raise UserInputError(f"only {len(out)} distinct {side} problems found for {n} asked at difficulty "
                             f"{difficulty} with operands up to {max_operand}; ask fewer or raise --max_operand")
    return out


def make_splits(n_train: int, n_eval: int, difficulty, seed: int,
                max_operand: int = 20) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problem lists that share no question text."""
    train = generate(n_train, difficulty, seed, "train", max_operand)
    questions = frozenset(p.question for p in train)
    held_out = generate(n_eval, difficulty, seed, "eval", max_operand, exclude=questions)
    if questions & {p.question for p in held_out}:  # cannot happen by the partition; checked anyway
        raise RuntimeError("train and eval problems overlap")
    return train, held_out


def write_jsonl(rows: Sequence[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------- eval

def read_eval_rows(path: str, limit: Optional[int] = None, flag: str = "--data") -> list[dict]:
    """Rows with a "prompt" and a reference: their "answer", else the number after "####"
    in "chosen". Returns [{"prompt", "reference", "difficulty"}] (difficulty None when the row
    has none), the first `limit` of them."""
    if not Path(path).is_file():
        raise UserInputError(f"{flag} {path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserInputError(f"{flag} {path} line {number}: not JSON ({e})") from None
            reference = record.get("answer") if isinstance(record, dict) else None
            if reference is None and isinstance(record, dict) and isinstance(record.get("chosen"), str):
                reference = extract_answer(record["chosen"])
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or _value(reference) is None:
                raise UserInputError(f"{flag} {path} line {number}: needs a string 'prompt' and a numeric "
                                     "'answer' (or a 'chosen' solution ending in '#### N')")
            rows.append({"prompt": record["prompt"], "reference": str(reference),
                         "difficulty": record.get("difficulty")})
            if limit is not None and len(rows) == limit:
                break
    if not rows:
        raise UserInputError(f"{flag} {path}: no rows")
    return rows


def load_model(path: str, device: str, flag: str = "--model"):
    """(model in eval mode on `device`, tokenizer) of a saved causal-LM folder; bf16 on
    CUDA, fp32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from dschat.models.model_utils import has_weights, load_tokenizer

    hf_logging.disable_progress_bar()  # a "Loading weights" bar clutters the per-row lines

    if not Path(path).is_dir() or not has_weights(path):
        raise UserInputError(f"{flag} {path}: not a model folder with weights (a step-1 output or "
                             "a step-3 actor/)")
    tokenizer = load_tokenizer(path)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserInputError(f"{flag} {path}: cannot load a causal LM ({str(e).splitlines()[0][:200]})") from None
    return model.to(device).eval(), tokenizer


def generate_greedy(model, tokenizer, chat, prompts: Sequence[str], max_new_tokens: int,
                    batch_size: int) -> list[str]:
    """Greedy answers to DS-Chat `prompts`, rendered by `chat` (a dschat.data.chat.ChatFormat)
    and left-padded per batch; each answer ends as step 3's do (stop token kept, text
    before a stop string) and is decoded without special tokens."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    out = []
    for start in range(0, len(prompts), batch_size):
        ids = [tokenizer(chat.prompt(p), add_special_tokens=chat.add_special_tokens)["input_ids"]
               for p in prompts[start:start + batch_size]]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        with torch.no_grad():
            seq = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, num_beams=1,
                                 max_new_tokens=max_new_tokens, eos_token_id=list(chat.stop_token_ids),
                                 pad_token_id=pad)
        for row in seq[:, width:].tolist():
            out.append(tokenizer.decode(row[:chat.answer_length(row, pad)], skip_special_tokens=True))
    return out


def evaluate(model, tokenizer, rows: Sequence[dict], *, chat_template: str = "auto",
             max_new_tokens: int = 256, batch_size: int = 32) -> tuple[float, list[dict]]:
    """Exact-match accuracy of greedy answers on `read_eval_rows` rows, and one record per
    row: index, prompt, reference, completion, prediction (number after "####"), correct."""
    from dschat.data.chat import ChatFormat
    from dschat.data.tokenize import end_of_conversation_text

    chat = ChatFormat(tokenizer, chat_template, end_of_conversation_text(tokenizer, None))
    completions = generate_greedy(model, tokenizer, chat, [r["prompt"] for r in rows], max_new_tokens,
                                  batch_size)
    records = [{"index": i, "prompt": r["prompt"], "reference": r["reference"], "completion": c,
                "prediction": extract_answer(c), "correct": is_correct(c, r["reference"]),
                "difficulty": r.get("difficulty")}
               for i, (r, c) in enumerate(zip(rows, completions))]
    return summarize(records)["accuracy"], records


def summarize(records: Sequence[dict]) -> dict:
    """Accuracy overall and per difficulty (operations per problem) of `evaluate`'s records,
    and the share of answers that gave a number after "####" at all."""
    by: dict[int, list[bool]] = {}
    for r in records:
        if r.get("difficulty") is not None:
            by.setdefault(int(r["difficulty"]), []).append(bool(r["correct"]))
    return {"accuracy": sum(r["correct"] for r in records) / len(records),
            "correct": sum(r["correct"] for r in records), "total": len(records),
            "answered": sum(r["prediction"] is not None for r in records) / len(records),
            "by_difficulty": {str(d): {"accuracy": sum(v) / len(v), "total": len(v)}
                              for d, v in sorted(by.items())}}


def pick_difficulty(summary: dict, low: float, high: float) -> str:
    """The difficulty ("3") whose accuracy in `summary["by_difficulty"]` lies in [low, high],
    nearest their middle; when no single one does, the narrowest range of consecutive
    difficulties ("1-2", a uniform mix as `make` draws it) whose expected accuracy, the mean
    of theirs, does. UserInputError when nothing does (the message lists them all)."""
    table = {int(d): v["accuracy"] for d, v in summary.get("by_difficulty", {}).items()}
    levels = sorted(table)
    middle = (low + high) / 2
    for width in range(1, len(levels) + 1):
        ranges = [levels[i:i + width] for i in range(len(levels) - width + 1)
                  if levels[i + width - 1] - levels[i] == width - 1]          # consecutive only
        inside = [(abs(sum(table[d] for d in r) / width - middle), r[0], r) for r in ranges
                  if low <= sum(table[d] for d in r) / width <= high]
        if inside:
            best = min(inside)[2]
            return str(best[0]) if width == 1 else f"{best[0]}-{best[-1]}"
    listed = ", ".join(f"{d}: {acc:.3f}" for d, acc in sorted(table.items())) or "none"
    raise UserInputError(f"no difficulty or mix of consecutive difficulties has an accuracy within "
                         f"[{low}, {high}] (by difficulty: {listed})")


# ---------------------------------------------------------------------------- CLI

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dschat.tasks.arithmetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write DIR/train.jsonl and DIR/eval.jsonl")
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--train", type=int, default=5000, help="training problems")
    make.add_argument("--eval", type=int, default=500, help="held-out problems")
    make.add_argument("--difficulty", default="3",
                      help=f"operations per problem, 1-{MAX_DIFFICULTY}, or a range such as 1-4 (a mix)")
    make.add_argument("--max_operand", type=_positive, default=20, help="largest number a step adds or removes")
    make.add_argument("--seed", type=int, default=1234)
    ev = sub.add_parser("eval", help="exact-match accuracy of a model's greedy answers")
    ev.add_argument("--model", required=True, help="a saved causal-LM folder (step-1 output, step-3 actor/)")
    ev.add_argument("--data", required=True, help="a JSONL file of `make` (eval.jsonl)")
    ev.add_argument("--max_new_tokens", type=_positive, default=256)
    ev.add_argument("--batch_size", type=_positive, default=32)
    ev.add_argument("--chat_template", default="auto", choices=("auto", "none"),
                    help="auto: the tokenizer's chat template when it has one; none: DS-Chat's raw text")
    ev.add_argument("--limit", type=_positive, default=None, help="evaluate the first N rows only")
    ev.add_argument("--jsonl", default=None, help="write one JSON record per row here")
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    ev.add_argument("--summary", default=None,
                    help="write the summary JSON here (accuracy overall and per difficulty)")
    pick = sub.add_parser("pick", help="print the difficulty (or mix of consecutive ones, '1-2') whose "
                                       "accuracy in an eval --summary lies in [--low, --high], nearest the middle")
    pick.add_argument("--summary", required=True, help="an eval --summary file of a mixed-difficulty set")
    pick.add_argument("--low", type=float, default=0.1, help="lowest accuracy accepted")
    pick.add_argument("--high", type=float, default=0.4, help="highest accuracy accepted")
    return p


def _make(args) -> None:
    if args.train < 0 or args.eval < 0:
        raise UserInputError(f"--train {args.train} / --eval {args.eval}: counts cannot be negative")
    train, held_out = make_splits(args.train, args.eval, args.difficulty, args.seed, args.max_operand)
    out = Path(args.out)
    write_jsonl([p.row() for p in train], out / "train.jsonl")
    write_jsonl([p.row() for p in held_out], out / "eval.jsonl")
    print(json.dumps({"train": str(out / "train.jsonl"), "eval": str(out / "eval.jsonl"),
                      "num_train": len(train), "num_eval": len(held_out), "difficulty": args.difficulty,
                      "max_operand": args.max_operand, "seed": args.seed}))


def _eval(args) -> None:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserInputError(f"--device {device}: no CUDA device on this machine")
    rows = read_eval_rows(args.data, args.limit)
    model, tokenizer = load_model(args.model, device)
    _, records = evaluate(model, tokenizer, rows, chat_template=args.chat_template,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    for r in records:
        print(f"{r['index']}\t{'ok' if r['correct'] else 'wrong'}\treference={r['reference']}\t"
              f"prediction={r['prediction']}")
    if args.jsonl:
        write_jsonl(records, Path(args.jsonl))
    summary = dict(summarize(records), model=args.model, data=args.data, device=device)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def _pick(args) -> None:
    try:
        summary = json.loads(Path(args.summary).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserInputError(f"--summary {args.summary}: not a readable summary ({e})") from None
    print(pick_difficulty(summary, args.low, args.high))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"make": _make, "eval": _eval, "pick": _pick}[args.command](args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
