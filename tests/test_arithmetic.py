"""The arithmetic task (dschat.tasks.arithmetic): generated problems and solutions, train /
eval disjointness, answer extraction, the reward function, and the make / eval CLI (eval on
a tiny random LLaMA with the bundled tokenizer, raw text and a ChatML template)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dschat.data.assets import bundled_tokenizer_path
from dschat.data.sources import load_source
from dschat.rlhf.reward_fn import load_reward_fn, score
from dschat.tasks import arithmetic as A
from dschat.utils.errors import UserInputError

REPO = Path(__file__).resolve().parents[1]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
LINE = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


# ------------------------------------------------------------------------ problems

def test_same_seed_same_problems_other_seed_other_problems():
    a = A.make_splits(40, 10, "1-4", seed=7)
    assert a == A.make_splits(40, 10, "1-4", seed=7)
    b = A.make_splits(40, 10, "1-4", seed=8)
    assert {p.question for p in a[0]} != {p.question for p in b[0]}


def test_train_and_eval_are_disjoint_even_across_seeds():
    train, held_out = A.make_splits(300, 60, "1-3", seed=1)
    assert len({p.question for p in train}) == 300 and len({p.question for p in held_out}) == 60
    assert not {p.question for p in train} & {p.question for p in held_out}
    other_train, _ = A.make_splits(300, 0, "1-3", seed=2)
    assert not {p.question for p in other_train} & {p.question for p in held_out}  # hash partition
    assert {A.side_of(p.question) for p in train} == {"train"}
    assert {A.side_of(p.question) for p in held_out} == {"eval"}


def _recompute(problem):
    value = problem.start
    for kind, args in problem.steps:
        value = {"add": lambda v: v + args[0], "sub": lambda v: v - args[0], "mul": lambda v: v * args[0],
                 "div": lambda v: v / args[0], "packs": lambda v: v + args[0] * args[1]}[kind](value)
    return value


@pytest.mark.parametrize("difficulty", ["1", "3", "2-6"])
def test_every_solution_is_right_and_shows_its_work(difficulty):
    lo, hi = A.parse_difficulty(difficulty)
    for p in A.make_splits(150, 30, difficulty, seed=3)[0]:
        assert lo <= len(p.steps) <= hi
        assert A.extract_answer(p.solution) == str(p.answer) == str(int(_recompute(p)))
        assert p.solution.endswith(f"\n#### {p.answer}")
        # every "a op b = c" line is true, and the running total chains from line to line
        lines = [m for m in (LINE.findall(line) for line in p.solution.splitlines()) if m]
        assert len(lines) == len(p.steps)
        running = p.start
        for ops in lines:
            for a, op, b, c in ops:
                assert OPS[op](int(a), int(b)) == int(c)
            assert int(ops[-1][0]) == running
            running = int(ops[-1][3])
        assert running == p.answer and p.answer >= 1
        assert A.extract_answer(p.rejected) != str(p.answer)
        assert A.exact_match_reward([""] * 2, [p.solution, p.rejected], answer=[str(p.answer)] * 2) == [1.0, 0.0]


def test_rows_are_ds_chat_rows():
    p = A.make_splits(1, 0, 2, seed=4)[0][0]
    row = p.row()
    assert row["prompt"] == f"\n\nHuman: {p.question} Put the final answer after ####.\n\nAssistant:"
    assert row["chosen"] == " " + p.solution and row["answer"] == str(p.answer) and row["difficulty"] == 2


def test_bad_difficulty_and_too_many_problems(monkeypatch):
    for bad in ("0", "9", "3-1", "x"):
        with pytest.raises(UserInputError, match="--difficulty"):
            A.parse_difficulty(bad)
    one = next(p for p in A.make_splits(5, 0, 1, seed=1)[0])  # a generator that only knows one problem
    monkeypatch.setattr(A, "make_problem", lambda rng, n_ops, max_operand: one)
    with pytest.raises(UserInputError, match="only 1 distinct train problems found for 3 asked"):
        A.generate(3, 1, seed=1, side="train")


# ------------------------------------------------------------------------ answers / reward

@pytest.mark.parametrize("text, expected", [
    ("so 3 + 4 = 7.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("####  42 ", "42"),
    ("#### 42.", "42"),
    ("####42", "42"),
    ("#### -5", "-5"),
    ("#### $1,000,000.", "1000000"),
    ("#### **12**", "12"),
    ("#### 2.50", "2.50"),
    ("#### 1 234 apples", "1234"),
    ("#### 3\nthen again #### 9", "9"),     # the last marks win
    ("#### 3 and #### none", None),          # nothing after the last marks
    ("The answer is 7.", None),
    ("", None),
    ("####", None),
])
def test_extract_answer(text, expected):
    assert A.extract_answer(text) == expected


def test_exact_match_reward_as_a_reward_fn():
    fn = load_reward_fn("dschat.tasks.arithmetic:exact_match_reward")
    answers = [" 3 + 4 = 7.\n#### 7", "#### 7.0", "#### 8", "no marks"]
    fields = [{"answer": "7", "difficulty": 1}, {"answer": 7}, {"answer": "7"}, {"answer": "7"}]
    rewards, valid = score(fn, [""] * 4, answers, fields)
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0] and valid.all()
    # without an answer field the reference comes from the chosen solution
    assert A.exact_match_reward(["", ""], ["#### 5", "#### 6"], chosen=[" x\n#### 5", " y\n#### 5"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="needs an 'answer'"):
        A.exact_match_reward([""], ["#### 5"])
    with pytest.raises(UserInputError, match=r"raised ValueError: reference answer 'five' is not a number .* on row 0"):
        score(fn, [""], ["#### 5"], [{"answer": "five"}])


# ------------------------------------------------------------------------ make CLI

def test_make_writes_train_and_eval_loadable_as_ds_chat_data(tmp_path, capsys):
    out = tmp_path / "arith"
    assert A.main(["make", "--out", str(out), "--train", "30", "--eval", "8", "--difficulty", "2",
                   "--seed", "5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_train"] == 30 and summary["num_eval"] == 8
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 30 and len(held_out) == 8
    assert set(train[0]) == {"prompt", "chosen", "rejected", "answer", "difficulty"}
    source = load_source(str(out))  # a --data_path folder: train*.jsonl / eval*.jsonl are its splits
    assert source.kind == "pair" and len(source.train) == 30 and len(source.eval) == 8
    assert source.train[0].prompt == train[0]["prompt"] and source.train[0].chosen == train[0]["chosen"]
    assert A.main(["make", "--out", str(out), "--train", "3", "--eval", "1", "--difficulty", "12"]) == 2
    assert "--difficulty 12" in capsys.readouterr().err


# ------------------------------------------------------------------------ eval

def _tiny_llama(folder, tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    A.main(["make", "--out", str(out), "--train", "4", "--eval", "6", "--difficulty", "2", "--seed", "1"])
    return out


def _check_eval_output(stdout, jsonl, n):
    summary = json.loads(stdout.strip().splitlines()[-1])
    records = [json.loads(x) for x in Path(jsonl).read_text().splitlines()]
    assert summary["total"] == len(records) == n
    assert set(records[0]) == {"index", "prompt", "reference", "completion", "prediction", "correct", "difficulty"}
    assert [r["index"] for r in records] == list(range(n))
    for r in records:
        assert r["correct"] == A.is_correct(r["completion"], r["reference"])
        assert r["prediction"] == A.extract_answer(r["completion"])
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / n)
    assert summary["correct"] == sum(r["correct"] for r in records)
    return records


def test_eval_cli_end_to_end_on_a_tiny_llama(task_dir, tmp_path):
    model = _tiny_llama(tmp_path / "llama", AutoTokenizer.from_pretrained(bundled_tokenizer_path()))
    out = tmp_path / "answers.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "dschat.tasks.arithmetic", "eval", "--model", model,
                           "--data", str(task_dir / "eval.jsonl"), "--limit", "4", "--max_new_tokens", "8",
                           "--batch_size", "3", "--chat_template", "none", "--jsonl", str(out),
                           "--summary", str(tmp_path / "summary.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _check_eval_output(proc.stdout, out, 4)
    first = json.loads((task_dir / "eval.jsonl").read_text().splitlines()[0])
    assert records[0]["prompt"] == first["prompt"] and records[0]["reference"] == first["answer"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["by_difficulty"] == {"2": {"accuracy": summary["accuracy"], "total": 4}}


def test_eval_with_a_chat_template_in_process(task_dir, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model = _tiny_llama(tmp_path / "chatml", tokenizer)
    out = tmp_path / "answers.jsonl"
    assert A.main(["eval", "--model", model, "--data", str(task_dir / "eval.jsonl"), "--limit", "4",
                   "--max_new_tokens", "6", "--jsonl", str(out), "--device", "cpu"]) == 0
    _check_eval_output(capsys.readouterr().out, out, 4)
    assert A.main(["eval", "--model", str(tmp_path / "nowhere"), "--data", str(task_dir / "eval.jsonl")]) == 2
    assert "--model" in capsys.readouterr().err


class _Parrot(torch.nn.Module):
    """A stand-in LM whose greedy answer to every prompt is `text` then eos."""

    def __init__(self, tokenizer, text):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.answer = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        tail = torch.tensor(self.answer[:max_new_tokens]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, tail], dim=1)


def test_evaluate_marks_right_answers_right():
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    rows = [{"prompt": "\n\nHuman: Q?\n\nAssistant:", "reference": ref} for ref in ("7", "8", "7")]
    accuracy, records = A.evaluate(_Parrot(tokenizer, " 3 + 4 = 7.\n#### 7"), tokenizer, rows,
                                   chat_template="none", batch_size=2)
    assert [r["correct"] for r in records] == [True, False, True] and accuracy == pytest.approx(2 / 3)
    assert records[0]["completion"] == " 3 + 4 = 7.\n#### 7" and records[0]["prediction"] == "7"


def _records(pairs):
    """evaluate()-style records from (difficulty, correct) pairs."""
    return [{"difficulty": d, "correct": ok, "prediction": "1" if ok else None} for d, ok in pairs]


def test_summary_by_difficulty_and_the_difficulty_pick(tmp_path, capsys):
    records = _records([(1, True)] * 9 + [(1, False)] + [(2, True)] * 3 + [(2, False)] * 7
                       + [(3, True)] + [(3, False)] * 9 + [(4, False)] * 10)
    summary = A.summarize(records)
    assert summary["accuracy"] == pytest.approx(13 / 40) and summary["answered"] == pytest.approx(13 / 40)
    assert {d: v["accuracy"] for d, v in summary["by_difficulty"].items()} == {"1": 0.9, "2": 0.3, "3": 0.1, "4": 0.0}
    assert A.pick_difficulty(summary, 0.1, 0.4) == "2"         # 0.3 is nearer 0.25 than 0.1 is
    assert A.pick_difficulty(summary, 0.05, 0.15) == "3"
    assert A.pick_difficulty(summary, 0.5, 0.7) == "1-2"       # no single one: the 1-2 mix expects 0.6
    with pytest.raises(UserInputError, match=r"within \[0.95, 1.0\].*1: 0.900, 2: 0.300"):
        A.pick_difficulty(summary, 0.95, 1.0)
    # the probe that chose the task on the GPU: one operation 0.407, two 0.077 -> the 1-2 mix (0.242)
    probe = {"by_difficulty": {"1": {"accuracy": 0.407}, "2": {"accuracy": 0.077}, "3": {"accuracy": 0.067}}}
    assert A.pick_difficulty(probe, 0.1, 0.4) == "1-2"
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert A.main(["pick", "--summary", str(path)]) == 0 and capsys.readouterr().out.strip() == "2"
    assert A.main(["pick", "--summary", str(tmp_path / "missing.json")]) == 2
    assert "--summary" in capsys.readouterr().err


def test_connectors_lower_case_the_sentence_they_join():
    joined = [re.search(re.escape(c) + r" (\w)", p.question) for p in A.generate(300, "2-6", 3, "train")
              for c in A.CONNECTORS]
    assert any(joined) and all(m.group(1).islower() for m in joined if m)   # "After that, by the end ..."


def test_compare_arithmetic_groups_seeds_against_the_start(tmp_path):
    from applications import compare_arithmetic

    for name, accuracy in (("grpo-seed1", 0.40), ("grpo-seed2", 0.50), ("rloo-seed1", 0.35)):
        run = tmp_path / name
        run.mkdir()
        (run / "arithmetic_eval.json").write_text(json.dumps({"accuracy": accuracy, "answered": 1.0}))
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "ppo/reward_mean": 0.1 * i, "ppo/samples_per_s": 10.0, "memory/peak_gib": 2.0})
            + "\n" for i in range(1, 11)))
    (tmp_path / "start.json").write_text(json.dumps({"accuracy": 0.30}))
    out, png = tmp_path / "table.md", tmp_path / "curves.png"
    runs = [str(tmp_path / n) for n in ("grpo-seed1", "grpo-seed2", "rloo-seed1", "ppo-seed1")]  # ppo: not done
    assert compare_arithmetic.main([*runs, "--start", str(tmp_path / "start.json"), "--out", str(out),
                                    "--plot", str(png)]) == 0
    lines = out.read_text().splitlines()
    assert lines[2].startswith("| start (before step 3) | 30.0 |")
    assert "| grpo-seed1 | 40.0 | +10.0 | 1.000 | 0.100 | 1.000 | 10 | 10.0 | 2.0 |" in lines
    mean_row = next(line for line in lines if "mean ± sd of 2" in line)
    assert "45.0 ± 7.1" in mean_row and "+15.0 ± 7.1" in mean_row and "10.0 ± 0.0" in mean_row
    assert sum("mean ± sd" in line for line in lines) == 1 and not any("ppo" in line for line in lines)
    assert png.stat().st_size > 1000
    assert compare_arithmetic.main([str(tmp_path / "ppo-seed1")]) == 2
