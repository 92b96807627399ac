"""Bad input gets one clear error (issue #7): exit code 2, a message naming the flag, file
or row, no traceback, and nothing already in --output_dir touched.

Table-driven; every case is `python main.py ...` with world size 1, run in a child forked
from one process that imported everything once (tests/dist/resume_forked_cases.py), so
the whole table takes seconds.
"""
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.resume_utils import make_step3_models
from tests.dist_utils import REPO
from tests.dist_utils import test_env as child_env

RUNNER = REPO / "tests" / "dist" / "resume_forked_cases.py"
PAIR = '{"prompt": "\\n\\nHuman: %s?\\n\\nAssistant:", "chosen": " yes", "rejected": " no"}\n'


def build_inputs(root: Path) -> dict:
    """Model folders and data files, good and broken."""
    from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format
    from dschat.models.reward_model import create_reward_model, save_reward_model
    tok = load_tokenizer(None)
    p = {"bloom": root / "bloom", "opt": root / "opt"}
    save_hf_format(create_hf_model(str(REPO / "configs/tiny/bloom.json"), tok, seed=1), tok, p["bloom"])
    save_hf_format(create_hf_model(str(REPO / "configs/tiny/opt.json"), tok, seed=1), tok, p["opt"])

    def variant(name, src, change):
        shutil.copytree(src, root / name)
        change(root / name)
        p[name] = root / name

    def truncate(file: Path, keep: int):
        file.write_bytes(file.read_bytes()[:keep])

    variant("no_weights", p["bloom"], lambda d: (d / "model.safetensors").unlink())
    variant("truncated", p["bloom"], lambda d: truncate(d / "model.safetensors", 5000))
    variant("opt_under_bloom", p["bloom"], lambda d: shutil.copy(p["opt"] / "model.safetensors", d))
    # a sharded checkpoint with one shard missing
    sharded = root / "sharded"
    model = create_hf_model(str(REPO / "configs/tiny/bloom.json"), tok, seed=1)
    model.save_pretrained(sharded, max_shard_size="200KB")
    tok.save_pretrained(sharded)
    sorted(sharded.glob("model-*.safetensors"))[-1].unlink()
    p["missing_shard"] = sharded

    p["actor"], p["critic"] = make_step3_models(root)
    variant("critic_truncated", p["critic"], lambda d: truncate(d / "model.safetensors", 3000))
    opt_rm = root / "opt_rm"
    save_reward_model(create_reward_model(str(REPO / "configs/tiny/opt.json"), tok, seed=2), tok, opt_rm)
    variant("critic_opt_under_bloom", p["critic"], lambda d: shutil.copy(opt_rm / "model.safetensors", d))

    (root / "empty.jsonl").write_text("")
    (root / "columns.jsonl").write_text('{"question": "a", "answer": "b"}\n' * 5)
    (root / "latin1.jsonl").write_bytes((PAIR % "caf\xe9" * 5).encode("latin-1"))
    whole = gzip.compress((PAIR % "hi" * 300).encode())
    (root / "truncated.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (root / "sft_only.jsonl").write_text('{"prompt": "\\n\\nHuman: hi?\\n\\nAssistant:", "response": " yes"}\n' * 20)
    return {k: str(v) for k, v in p.items()} | {"root": str(root)}


def step1(p, out, *extra, model=None):
    return ["--model_name_or_path", model or p["bloom"], "--dtype", "fp32", "--output_dir", out,
            "--max_seq_len", "32", "--per_device_train_batch_size", "2", "--max_steps", "1", "--eval_iters", "1",
            "--data_output_path", f"{p['root']}/cache", *extra]


def step2(p, out, *extra):
    return step1(p, out, *extra)


def step3(p, out, *extra, actor=None, critic=None):
    return ["--actor_model_name_or_path", actor or p["actor"], "--critic_model_name_or_path", critic or p["critic"],
            "--dtype", "fp32", "--output_dir", out, "--data_output_path", f"{p['root']}/cache",
            "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
            "--max_prompt_seq_len", "24", "--max_answer_seq_len", "4", "--max_steps", "1", *extra]


def data(p, name):
    return ["--data_path", f"{p['root']}/{name}"]


# id: (step, argv(p, out), strings the error must contain)
CASES = {
    "empty_file": (1, lambda p, o: step1(p, o, *data(p, "empty.jsonl")), ["empty.jsonl", "is empty"]),
    "wrong_columns": (1, lambda p, o: step1(p, o, *data(p, "columns.jsonl")),
                      ["columns.jsonl", "needs columns", "found: question, answer"]),
    "not_utf8": (1, lambda p, o: step1(p, o, *data(p, "latin1.jsonl")), ["latin1.jsonl", "not UTF-8"]),
    "truncated_gz": (1, lambda p, o: step1(p, o, *data(p, "truncated.jsonl.gz")),
                     ["truncated.jsonl.gz", "cannot read it", "end-of-stream"]),
    "no_pairs_for_step2": (2, lambda p, o: step2(p, o, *data(p, "sft_only.jsonl")), ["sft_only.jsonl"]),
    "every_prompt_too_long": (3, lambda p, o: step3(p, o, "--max_prompt_seq_len", "3"),
                              ["no prompt", "fits --max_prompt_seq_len 3"]),
    "missing_safetensors": (1, lambda p, o: step1(p, o, model=p["no_weights"]),
                            ["no_weights", "without weights", "model.safetensors"]),
    "missing_shard": (1, lambda p, o: step1(p, o, model=p["missing_shard"]), ["sharded", "cannot load weights"]),
    "truncated_safetensors": (1, lambda p, o: step1(p, o, model=p["truncated"]),
                              ["truncated", "cannot load weights", "SafetensorError"]),
    "other_family_weights": (1, lambda p, o: step1(p, o, model=p["opt_under_bloom"]),
                             ["opt_under_bloom", "do not fit a bloom model", "another model family"]),
    "other_family_actor": (3, lambda p, o: step3(p, o, actor=p["opt_under_bloom"]),
                           ["opt_under_bloom", "do not fit a bloom model"]),
    "truncated_critic": (3, lambda p, o: step3(p, o, critic=p["critic_truncated"]),
                         ["critic_truncated/model.safetensors", "unreadable"]),
    "other_family_critic": (3, lambda p, o: step3(p, o, critic=p["critic_opt_under_bloom"]),
                            ["--critic_model_name_or_path", "critic_opt_under_bloom",
                             "do not fit a bloom reward model"]),
    "causal_lm_as_critic": (3, lambda p, o: step3(p, o, critic=p["bloom"]),
                            ["--critic_model_name_or_path", "is not a reward model"]),
    "flags_step1": (1, lambda p, o: step1(p, o, "--zero_stage", "0", "--offload", "--only_optimize_lora",
                                          "--lora_module_name", "h.", "--save_interval", "-1", "--offload_ratio", "0.5",
                                          "--max_nonfinite_in_a_row", "0", "--data_path", "./no/such.jsonl"),
                    ["--offload needs --zero_stage", "--only_optimize_lora needs --lora_dim",
                     "--offload_ratio below 1 is DeepSpeed's partial offload: it needs --offload and ZeRO stage 3",
                     "--lora_module_name needs --lora_dim", "--save_interval must be >= 0",
                     "--max_nonfinite_in_a_row must be >= 1", "./no/such.jsonl: no such file"]),
    "flags_step2": (2, lambda p, o: step2(p, o, "--lora_dim", "4", "--only_optimize_lora", "--gradient_checkpointing",
                                          "--num_padding_at_beginning", "-1", "--keep_last", "-2", "--dropout", "1.5"),
                    ["--num_padding_at_beginning must be >= 0", "--keep_last must be >= 0",
                     "--dropout must be in [0, 1)"]),
    "flags_step3": (3, lambda p, o: step3(p, o, "--per_device_training_batch_size", "3", "--offload_reference_model",
                                          "--actor_lora_module_name", "h.", "--top_p", "1.5",
                                          "--min_answer_seq_len", "9", "--unpin_actor_parameters",
                                          "--offload_optimizer_only", "--offload_ratio", "1.5"),
                    ["must be a multiple of --per_device_training_batch_size (3)",
                     "--offload_reference_model needs the reference model at ZeRO-3", "--actor_lora_module_name needs",
                     "--top_p must be in (0, 1]", "--min_answer_seq_len 9 exceeds", "--unpin_actor_parameters needs",
                     "--offload_optimizer_only needs --offload", "--offload_ratio must be in (0, 1], got 1.5"]),
    # the tiny OPT has 512 learned positions
    "longer_than_positions": (1, lambda p, o: step1(p, o, "--max_seq_len", "600", model=p["opt"]),
                              ["--max_seq_len = 600", "position table", "opt: 512 learned positions"]),
    "fp16_on_cpu": (1, lambda p, o: step1(p, o, "--dtype", "fp16"), ["--dtype fp16", "needs a GPU"]),
    "output_is_the_input_model": (1, lambda p, o: step1(p, p["bloom"]),
                                  ["--output_dir", "would overwrite its own input model"]),
    "earlier_checkpoints_without_resume": (1, lambda p, o: step1(p, o, "--save_interval", "2"),
                                           ["holds checkpoints of an earlier run", "step_00000004", "--resume"]),
}


def earlier_checkpoint(out: Path) -> None:
    """A complete checkpoint left by an earlier run (marker and state only)."""
    from dschat.utils import checkpoint as C
    ckpt = C.checkpoint_root(out) / C.checkpoint_name(4)
    ckpt.mkdir(parents=True)
    (ckpt / C.STATE_FILE).write_text('{"step": 4}')
    (ckpt / C.MARKER).write_text("{}")


def snapshot(folder: Path) -> dict:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    p = build_inputs(root)
    cases, outs = [], {}
    for name, (step, argv, _) in CASES.items():
        out = root / "out" / name
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("from an earlier run\n")
        (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n')
        if name == "earlier_checkpoints_without_resume":
            earlier_checkpoint(out)
        outs[name] = out
        cases.append({"step": step, "argv": [str(a) for a in argv(p, str(out))]})
    fresh = root / "out" / "resume_fresh"
    cases.append({"step": 1, "argv": step1(p, str(fresh), "--resume")})
    before = {name: snapshot(out) for name, out in outs.items()} | {"bloom": snapshot(Path(p["bloom"]))}
    (root / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(RUNNER), "--cases", str(root / "cases.json"),
                           "--out", str(root / "results.json")], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads((root / "results.json").read_text())
    after = {name: snapshot(out) for name, out in outs.items()} | {"bloom": snapshot(Path(p["bloom"]))}
    return dict(zip([*CASES, "resume_fresh"], results)), before, after


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_error(outcomes, name):
    results, before, after = outcomes
    r = results[name]
    err = r["stderr"]
    assert r["rc"] == 2, (r["rc"], err[-3000:], r["stdout"][-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert err.count("error: ") == 1, err[-3000:]
    message = err[err.index("error: "):]
    for needle in CASES[name][2]:
        assert needle in message, (needle, message)
    assert after[name] == before[name]  # --output_dir untouched
    assert after["bloom"] == before["bloom"]


def test_resume_without_checkpoints_is_a_fresh_start(outcomes):
    r = outcomes[0]["resume_fresh"]
    assert r["rc"] == 0, r["stderr"][-3000:]
    assert "--resume: no complete checkpoint" in r["stdout"] and "starting from scratch" in r["stdout"]


def test_learned_position_tables_bound_the_sequence():
    """Step 3 checks prompt + answer against the actor's and critic's position tables; only
    families with learned positions have one (ALiBi and rotary ones do not)."""
    from dschat.cli.validate import _fits_positions
    flags = "--max_prompt_seq_len + --max_answer_seq_len"
    got = _fits_positions(str(REPO / "configs/tiny/opt.json"), 513, flags, "actor_model_name_or_path")
    assert len(got) == 1 and "= 513" in got[0] and "opt: 512 learned positions" in got[0]
    assert _fits_positions(str(REPO / "configs/tiny/opt.json"), 512, flags, "actor_model_name_or_path") == []
    gpt2 = _fits_positions(str(REPO / "configs/tiny/gpt2.json"), 10 ** 6, flags, "critic_model_name_or_path")
    assert len(gpt2) == 1 and "--critic_model_name_or_path" in gpt2[0]
    for family in ("bloom", "llama", "gpt_neox"):
        assert _fits_positions(str(REPO / f"configs/tiny/{family}.json"), 10 ** 6, flags, "x") == []
    assert _fits_positions("org/hub-name", 10 ** 6, flags, "x") == []      # nothing fetched
