"""Step 2 DPO: the maths against upstream DS-Chat's (and TRL's) few lines re-typed here,
per family on real tokenised pairs, and the entry point on real DeepSpeed engines
(ZeRO-3 on 2 CPU ranks equals ZeRO-0 on 1 rank; resume; the saved folder reloads)."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from applications.e2e import plan, presets
from dschat.data import DataCollatorReward, bundled_tokenizer_path, create_prompt_dataset
from dschat.models.model_utils import load_tokenizer
from dschat.rlhf.dpo import answer_mask, divergence_index, dpo_losses, sequence_logps, split_pairs, token_kl_sum
from dschat.utils import checkpoint as C
from dschat.utils.metrics import read_metrics
from tests.dist_utils import REPO, run_deepspeed, run_python

MAIN = REPO / "training" / "step2_dpo_finetuning" / "main.py"
PAD = 0


# ------------------------------------------------------------------ upstream, re-typed
def upstream_label_mask(input_ids, pad_token_id):
    """DS-Chat step2_dpo_finetuning/main.py: prompt masked up to the first difference."""
    batch_size = input_ids.shape[0] // 2
    chosen_input_ids, rejected_input_ids = input_ids[:batch_size], input_ids[batch_size:]
    label_mask = (input_ids != pad_token_id).int()
    for i in range(batch_size):
        divergence_ind = (chosen_input_ids[i] != rejected_input_ids[i]).nonzero().squeeze(-1)
        if len(divergence_ind) > 0:
            divergence_ind = divergence_ind[0]
        else:
            divergence_ind = 0
        label_mask[i][:divergence_ind] = 0
        label_mask[i + batch_size][:divergence_ind] = 0
    return label_mask


def upstream_get_batch_logps(logits, input_ids, label_mask):
    labels = input_ids.clone() * label_mask
    labels = labels[:, 1:]
    label_mask = label_mask[:, 1:]
    logits = logits[:, :-1, :]
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token_logps * label_mask).sum(-1)


def upstream_loss(logps, ref_logps, beta, label_smoothing):
    batch_size = logps.shape[0] // 2
    chosen_logps, rejected_logps = logps[:batch_size], logps[batch_size:]
    ref_chosen_logps, ref_rejected_logps = ref_logps[:batch_size], ref_logps[batch_size:]
    logits = beta * ((chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps))
    return (-F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing).mean(0)


def trl_loss(pc, pr, rc, rr, beta, loss_type):
    """TRL DPOTrainer.dpo_loss, ipo and hinge branches."""
    logits = (pc - pr) - (rc - rr)
    if loss_type == "ipo":
        return ((logits - 1 / (2 * beta)) ** 2).mean()
    return torch.relu(1 - beta * logits).mean()


def toy_batch(seed=0, B=3, L=9, V=11):
    """Pairs with a shared prompt of 2-4 tokens, answers right-padded with PAD."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (2 * B, L), generator=g)
    for i, (prompt, len_c, len_r) in enumerate([(2, 7, 9), (4, 9, 6), (3, 5, 5)][:B]):
        ids[B + i, :prompt] = ids[i, :prompt]
        ids[B + i, prompt] = (ids[i, prompt] % (V - 1)) + 1  # differ right after the prompt
        ids[i, len_c:] = PAD
        ids[B + i, len_r:] = PAD
    att = (ids != PAD).long()
    return ids, att, torch.randn(2 * B, L, V, generator=g), torch.randn(2 * B, L, V, generator=g)


# ------------------------------------------------------------------ maths
def test_answer_mask_by_hand():
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 0, 0, 0],     # chosen
                        [5, 6, 9, 0, 0], [5, 6, 7, 0, 0]])    # rejected
    att = (ids != 0).long()
    assert divergence_index(*split_pairs(ids)).tolist() == [2, 2]
    # pair 1: the chosen answer is empty (it ends where the rejected one goes on)
    assert answer_mask(ids, att).tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0],
                                              [0, 0, 1, 0, 0], [0, 0, 1, 0, 0]]
    same = torch.tensor([[1, 2, 3], [1, 2, 3]])
    assert answer_mask(same, torch.ones_like(same)).tolist() == [[1, 1, 1], [1, 1, 1]]  # upstream: 0


def test_sequence_logps_and_mask_equal_upstream():
    ids, att, logits, _ = toy_batch()
    mask = answer_mask(ids, att)
    assert torch.equal(mask, upstream_label_mask(ids, PAD).long())
    ours, tokens = sequence_logps(logits, ids, mask)
    torch.testing.assert_close(ours, upstream_get_batch_logps(logits, ids, upstream_label_mask(ids, PAD)))
    assert tokens.tolist() == mask[:, 1:].sum(1).float().tolist()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_loss_equals_upstream(beta, label_smoothing):
    ids, att, logits, ref_logits = toy_batch(seed=1)
    mask = answer_mask(ids, att)
    logps, _ = sequence_logps(logits * 3, ids, mask)
    ref_logps, _ = sequence_logps(ref_logits, ids, mask)
    (pc, pr), (rc, rr) = split_pairs(logps), split_pairs(ref_logps)
    ours = dpo_losses(pc, pr, rc, rr, beta=beta, label_smoothing=label_smoothing, loss_type="sigmoid").mean()
    label_mask = upstream_label_mask(ids, PAD)
    want = upstream_loss(upstream_get_batch_logps(logits * 3, ids, label_mask),
                         upstream_get_batch_logps(ref_logits, ids, label_mask), beta, label_smoothing)
    torch.testing.assert_close(ours, want)


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_ipo_and_hinge_equal_trl(loss_type):
    ids, att, logits, ref_logits = toy_batch(seed=2)
    mask = answer_mask(ids, att)
    (pc, pr), (rc, rr) = split_pairs(sequence_logps(logits, ids, mask)[0]), \
        split_pairs(sequence_logps(ref_logits, ids, mask)[0])
    ours = dpo_losses(pc, pr, rc, rr, beta=0.2, loss_type=loss_type).mean()
    torch.testing.assert_close(ours, trl_loss(pc, pr, rc, rr, 0.2, loss_type))
    # and by hand on one pair: margin h = (-1 - -3) - (-4 - -5) = 1
    one = [torch.tensor([v]) for v in (-1.0, -4.0, -3.0, -5.0)]
    hand = {"ipo": (1 - 1 / 0.4) ** 2, "hinge": max(0.0, 1 - 0.2 * 1)}[loss_type]
    assert dpo_losses(*one, beta=0.2, loss_type=loss_type).item() == pytest.approx(hand)


def test_kl_is_zero_for_equal_models_and_matches_a_hand_value():
    ids, att, logits, ref_logits = toy_batch(seed=3)
    mask = answer_mask(ids, att)
    assert token_kl_sum(logits, logits, mask).item() == pytest.approx(0.0, abs=1e-6)
    # one position, two tokens: KL([.5,.5] || [.25,.75]) = .5 ln 2 + .5 ln(2/3)
    p = torch.log(torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]))
    q = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]))
    kl = token_kl_sum(p, q, torch.tensor([[1, 1]])).item()
    assert kl == pytest.approx(0.5 * torch.log(torch.tensor(2.0)).item() + 0.5 * torch.log(torch.tensor(2 / 3)).item())


# ------------------------------------------------------------------ per family, real pairs
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    tokenizer = load_tokenizer(str(bundled_tokenizer_path()))
    train, _ = create_prompt_dataset(0, ["dschat/synthetic-assistant"], "2,4,4",
                                     str(tmp_path_factory.mktemp("dpo_cache")), 2, 1234, tokenizer, 64)
    batch = DataCollatorReward()([train[i] for i in range(4)])
    width = int(batch["attention_mask"].sum(1).max())  # drop the all-padding columns
    return {k: v[:, :width] for k, v in batch.items()}


@pytest.mark.parametrize("family", ["bloom-6heads", "opt", "llama", "gpt_neox"])
def test_family_forward_loss_and_a_few_steps(family, pairs):
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "configs" / "tiny" / f"{family}.json")
    policy = AutoModelForCausalLM.from_config(config).float()
    ref = AutoModelForCausalLM.from_config(config).float().eval()
    ref.load_state_dict(policy.state_dict())
    ids, att = pairs["input_ids"], pairs["attention_mask"]
    mask = answer_mask(ids, att)
    # the prompt ("\n\nHuman: ...\n\nAssistant:") is masked in every row, the answer is not
    assert (mask.sum(1) > 0).all() and (mask[:, :8] == 0).all()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, attention_mask=att).logits
    ref_logps, _ = sequence_logps(ref_logits, ids, mask)
    torch.testing.assert_close(ref_logps, upstream_get_batch_logps(ref_logits, ids, upstream_label_mask(ids, PAD)))
    # the first-difference boundary is exact for the loss: counting the whole sequences
    # (prompt and any shared answer prefix too) gives the same margins
    whole, _ = sequence_logps(ref_logits, ids, att)
    policy_whole, _ = sequence_logps(ref_logits * 1.3, ids, att)
    policy_ans, _ = sequence_logps(ref_logits * 1.3, ids, mask)
    a = dpo_losses(*split_pairs(policy_whole), *split_pairs(whole), beta=0.1)
    b = dpo_losses(*split_pairs(policy_ans), *split_pairs(ref_logps), beta=0.1)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)

    optimizer = torch.optim.Adam(policy.parameters(), lr=2e-3)
    losses = []
    for _ in range(3):
        logps, _ = sequence_logps(policy(input_ids=ids, attention_mask=att).logits, ids, mask)
        loss = dpo_losses(*split_pairs(logps), *split_pairs(ref_logps), beta=0.1).mean()
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[0] == pytest.approx(0.6931472, abs=1e-5)  # policy == reference: log 2
    assert losses[-1] < losses[0] - 0.01, losses


# ------------------------------------------------------------------ entry point
def main_module():
    spec = importlib.util.spec_from_file_location("dpo_main", MAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_explains_every_flag_and_keeps_upstream_defaults():
    parser = main_module().build_parser()
    missing = [a.dest for a in parser._actions if a.dest != "help" and not (a.help or "").strip()]
    assert not missing, missing
    args = parser.parse_args(["--model_name_or_path", "m"])
    got = (args.beta, args.label_smoothing, args.learning_rate, args.zero_stage, args.dtype)
    assert got == (0.1, 0.0, 1e-3, 0, "fp16")
    assert args.loss_type == "sigmoid" and args.rpo_alpha is None and args.data_split == "2,4,4"


def test_bad_dpo_flags_are_one_error(tmp_path):
    proc = run_python(MAIN, ["--model_name_or_path", "configs/tiny/bloom.json", "--dtype", "fp32",
                             "--output_dir", tmp_path, "--beta", "0", "--loss_type", "hinge",
                             "--label_smoothing", "0.1", "--rpo_alpha", "-1", "--offload_reference_model"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for flag in ("--beta", "--label_smoothing applies", "--rpo_alpha", "--offload_reference_model"):
        assert flag in proc.stderr + proc.stdout, flag


def dpo_args(out, batch, steps=5, extra=()):
    return ["--model_name_or_path", "configs/tiny/bloom.json", "--dtype", "fp32", "--output_dir", out,
            "--max_seq_len", "64", "--per_device_train_batch_size", str(batch), "--per_device_eval_batch_size", "16",
            "--max_steps", str(steps), "--eval_iters", "100", "--data_output_path", Path(out) / "cache",
            "--dropout", "0", "--gradient_accumulation_steps", "2", "--label_smoothing", "0.1",
            "--rpo_alpha", "0.5", "--num_warmup_steps", "1", *extra]


def metric(out, key):
    return [r[key] for r in read_metrics(Path(out) / "metrics.jsonl") if key in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_runs")
    z3, z0, res = tmp / "z3", tmp / "z0", tmp / "res"
    # the same global batch (2 micro-batches of 8 pairs) on 2 ranks x 4 and 1 rank x 8
    run_deepspeed(MAIN, dpo_args(z3, 4, extra=["--zero_stage", "3"]), num_gpus=2)
    run_python(MAIN, dpo_args(z0, 8, extra=["--zero_stage", "0", "--save_interval", "2", "--keep_last", "0"]))
    shutil.copytree(C.checkpoint_root(z0) / C.checkpoint_name(2), C.checkpoint_root(res) / C.checkpoint_name(2))
    run_python(MAIN, dpo_args(res, 8, extra=["--zero_stage", "0", "--resume"]))
    return z3, z0, res


def test_zero3_two_ranks_equals_zero0_one_rank(runs):
    z3, z0, _ = runs
    a, b = metric(z3, "train/loss"), metric(z0, "train/loss")
    assert len(a) == len(b) == 5
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    ea, eb = metric(z3, "eval/acc"), metric(z0, "eval/acc")
    assert ea == pytest.approx(eb, abs=1e-6)
    final = json.loads((z3 / "training_config.json").read_text())["final_eval"]
    for key in ("loss", "acc", "margin", "chosen_logps", "rejected_logps", "chosen_reward", "kl_ref"):
        assert key in final, key
    assert final["acc"] > 0.5 and final["margin"] > 0 and final["kl_ref"] > 0, final


def test_resume_is_exact(runs):
    _, z0, res = runs
    full = dict(zip(range(1, 6), metric(z0, "train/loss")))
    resumed = [r for r in read_metrics(res / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert all(r["train/loss"] == full[r["step"]] for r in resumed), (full, resumed)


def test_saved_model_reloads_with_plain_from_pretrained(runs):
    """The ZeRO-3 run's folder: plain HF loading, and its chosen log-probs over every eval
    pair equal the run's final evaluation."""
    z3 = runs[0]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "metrics.jsonl"):
        assert (z3 / f).exists(), f
    model = AutoModelForCausalLM.from_pretrained(z3).eval()
    tokenizer = load_tokenizer(str(z3))
    _, eval_data = create_prompt_dataset(0, ["dschat/synthetic-assistant"], "2,4,4", str(z3 / "cache"), 2, 1234,
                                         tokenizer, 64)
    batch = DataCollatorReward()([eval_data[i] for i in range(len(eval_data))])
    mask = answer_mask(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    chosen, _ = split_pairs(sequence_logps(logits, batch["input_ids"], mask)[0])
    final = json.loads((z3 / "training_config.json").read_text())["final_eval"]
    assert chosen.mean().item() == pytest.approx(final["chosen_logps"], abs=1e-3)


# ------------------------------------------------------------------ e2e_rlhf.py --align dpo
E2E = REPO / "applications" / "e2e_rlhf.py"


@pytest.fixture(scope="module")
def e2e():
    import sys
    name = "dschat_e2e_rlhf"
    if name not in sys.modules:  # registered: its dataclasses need that
        spec = importlib.util.spec_from_file_location(name, E2E)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_e2e_align_dpo_plans_step1_then_dpo_for_every_preset(e2e, tmp_path):
    parse = main_module().parse_args
    for path in sorted((REPO / "configs" / "presets").glob("*.json")):
        for deployment in presets.load_preset(path.stem)["deployments"]:
            args = e2e.parse_args(["--actor-model", path.stem, "--deployment-type", deployment,
                                   "--output-dir", str(tmp_path), "--align", "dpo", "--step2-args=--beta 0.2"])
            actor = presets.resolve_model(args.actor_model, "actor", None, False, tmp_path)
            steps = plan.build_plan(args, actor, None, deployment)
            assert [s.name for s in steps] == ["step 1 (SFT)", "step 2 (DPO)"]
            dpo = parse(steps[1].argv[1:])  # argparse exits on a flag the DPO step does not know
            assert dpo.model_name_or_path == str(tmp_path / "step1") and dpo.beta == 0.2
            assert dpo.zero_stage == int(steps[0].flags["zero_stage"])
            assert presets.dpo_memory_gb(steps[1].flags, actor.preset, 8)["total"] > 0


def test_e2e_align_dpo_report_has_the_dpo_rows(e2e, tmp_path):
    """Both outputs present: nothing is launched, the report reads their metrics."""
    out = tmp_path / "run"
    metrics = {"step1": [{"step": 0, "eval/ppl": 900.0}, {"step": 10, "eval/ppl": 3.5}],
               "step2_dpo": [{"step": 0, "eval/acc": 0.0, "eval/margin": 0.0, "eval/kl_ref": 0.0},
                             {"step": 8, "eval/acc": 0.95, "eval/margin": 1.5, "eval/kl_ref": 0.1,
                              "train/loss": 0.3}]}
    for folder, records in metrics.items():
        (out / folder).mkdir(parents=True)
        for f in ("model.safetensors", "config.json"):
            (out / folder / f).write_text("{}")
        with open(out / folder / "metrics.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps({"time": 0, **r}) + "\n")
    assert e2e.main(["--output-dir", str(out), "--align", "dpo"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["dpo_eval"]["acc"] == {"before": 0.0, "after": 0.95, "steps": 8}
    md = (out / "report.md").read_text()
    assert "| DPO eval implicit-reward accuracy (chosen above rejected) (step 2 DPO, 8 steps) | 0.000 | 0.950 |" in md
    assert "| SFT eval perplexity" in md and "reward-model eval accuracy" not in md
