"""Data pipeline: bundled assets, sources and formats, --data_split, tokenisation, cache.

Fast and in-process: every fixture file is written into tmp_path; nothing downloads.
"""
import csv
import gzip
import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from dschat.data import (  # noqa: E402
    BUNDLED_DATASET_NAME,
    DataCollatorReward,
    DataCollatorRLHF,
    DataCollatorSFT,
    bundled_dataset_path,
    bundled_tokenizer_path,
    create_prompt_dataset,
    create_unsupervised_dataset,
    load_source,
    parse_data_split,
    prompt_cache_dir,
    split_conversation_pair,
)
from dschat.data import datasets as data_datasets  # noqa: E402
from dschat.data.datasets import phase_rows  # noqa: E402
from dschat.data.split import chunk_indices, permutation  # noqa: E402
from dschat.utils.errors import UserInputError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HH_SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "hh-rlhf" \
    / "harmless-base-test.jsonl.gz"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(bundled_tokenizer_path())


@pytest.fixture(scope="module")
def bundled_rows():
    with open(bundled_dataset_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def data_log(caplog):
    """Capture the dschat.data logger (it does not propagate to the root logger)."""
    logger = logging.getLogger("dschat.data")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="dschat.data")
    yield caplog
    logger.removeHandler(caplog.handler)


def dahoas_rows(n=40, prefix="q"):
    return [{"prompt": f"\n\nHuman: {prefix}{i} what is {i} plus 1?\n\nAssistant:",
             "chosen": f" Sure! {i} plus 1 is {i + 1}.",
             "rejected": f" Sure! {i} plus 1 is {i + 2}.",
             "response": f" Sure! {i} plus 1 is {i + 1}."} for i in range(n)]


def write_jsonl(path, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------ bundled assets
def test_tokenizer_special_ids_and_round_trip(tok, bundled_rows):
    assert len(tok) <= 1024
    assert (tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token) == \
        ("<pad>", "<|endoftext|>", "<s>", "<unk>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<pad>", "<|endoftext|>", "<s>", "<unk>"]) == [0, 1, 2, 3]
    # No automatic bos/eos; the eos text appended by step 1 maps to the eos id.
    ids = tok("\n\nHuman: hi\n\nAssistant: Sure!")["input_ids"]
    assert ids and tok.bos_token_id not in ids and tok.eos_token_id not in ids
    assert tok("ok" + tok.eos_token)["input_ids"][-1] == tok.eos_token_id
    texts = [r[k] for r in bundled_rows for k in ("prompt", "chosen", "rejected")]
    texts += [bundled_rows[0]["prompt"] + bundled_rows[0]["chosen"],
              "\n\n\nHuman:  two  spaces, ünïcödé ’quotes’ 😀\t tab \n", " leading space"]
    for text in texts:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_bundled_dataset_shape_and_lengths(tok, bundled_rows):
    assert 3500 <= len(bundled_rows) <= 4500
    for row in bundled_rows:
        assert set(row) == {"prompt", "chosen", "rejected", "response"}
        assert row["prompt"].startswith("\n\nHuman: ") and row["prompt"].endswith("\n\nAssistant:")
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
        assert row["response"] == row["chosen"] != row["rejected"]
    assert max(len(tok(r["prompt"])["input_ids"]) for r in bundled_rows) <= 24
    assert max(len(tok(r["chosen"])["input_ids"]) for r in bundled_rows) <= 20
    assert max(len(tok(r["rejected"])["input_ids"]) for r in bundled_rows) <= 24


def test_make_demo_assets_check():
    spec = importlib.util.spec_from_file_location("make_demo_assets",
                                                  REPO / "scripts" / "make_demo_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check() == []


def test_bundled_data_all_three_phases(tok, tmp_path):
    args = dict(local_rank=0, data_path=[BUNDLED_DATASET_NAME], data_split="2,4,4",
                output_path=str(tmp_path), seed=1234, tokenizer=tok)
    train1, eval1 = create_prompt_dataset(train_phase=1, max_seq_len=48, **args)
    train2, eval2 = create_prompt_dataset(train_phase=2, max_seq_len=48, **args)
    train3, eval3 = create_prompt_dataset(train_phase=3, max_seq_len=24, **args)
    # 4000 rows -> 3600 train / 400 eval, cut 2:4:4.
    assert (len(train1), len(train2), len(train3)) == (720, 1440, 1440)
    assert (len(eval1), len(eval2), len(eval3)) == (80, 160, 160)

    item = train1[0]
    assert set(item) == {"input_ids", "attention_mask", "labels"}
    assert all(v.dtype == torch.long and v.shape == (48,) for v in item.values())
    n = int(item["attention_mask"].sum())
    assert item["attention_mask"][:n].all() and not item["attention_mask"][n:].any()
    assert item["input_ids"][n - 1] == tok.eos_token_id
    assert (item["input_ids"][n:] == tok.pad_token_id).all()
    assert (item["labels"][n:] == -100).all() and torch.equal(item["labels"][:n],
                                                              item["input_ids"][:n])
    text = tok.decode(item["input_ids"][:n - 1])
    assert text.startswith("\n\nHuman: ") and "\n\nAssistant: " in text
    batch = DataCollatorSFT()([train1[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 48) and batch["labels"].shape == (4, 48)

    pair = train2[0]
    assert set(pair) == {"chosen_input_ids", "chosen_attention_mask", "rejected_input_ids",
                         "rejected_attention_mask"}
    assert not torch.equal(pair["chosen_input_ids"], pair["rejected_input_ids"])
    batch = DataCollatorReward()([train2[i] for i in range(3)])
    assert batch["input_ids"].shape == (6, 48) and batch["attention_mask"].shape == (6, 48)
    for i in range(3):
        assert torch.equal(batch["input_ids"][i], train2[i]["chosen_input_ids"])
        assert torch.equal(batch["input_ids"][3 + i], train2[i]["rejected_input_ids"])

    prompt = train3[0]["prompt_input_ids"]
    assert prompt.dim() == 1 and prompt.dtype == torch.long and prompt.numel() <= 24
    assert tok.decode(prompt).endswith("\n\nAssistant:")
    batch = DataCollatorRLHF(24, tok.pad_token_id)([train3[i] for i in range(5)])
    assert batch["prompt"].shape == (5, 24) and batch["prompt_att_mask"].shape == (5, 24)
    for i in range(5):
        p = train3[i]["prompt_input_ids"]
        assert torch.equal(batch["prompt"][i, 24 - p.numel():], p)  # left-padded
        assert (batch["prompt"][i, :24 - p.numel()] == tok.pad_token_id).all()
        assert int(batch["prompt_att_mask"][i].sum()) == p.numel()
        assert batch["prompt_att_mask"][i, -1] == 1


def test_eot_token_and_truncation(tok, tmp_path):
    args = dict(local_rank=0, data_path=[BUNDLED_DATASET_NAME], data_split="1,0,0",
                output_path=str(tmp_path), train_phase=1, seed=1, tokenizer=tok)
    train, _ = create_prompt_dataset(max_seq_len=48, end_of_conversation_token="<s>", **args)
    item = train[0]
    n = int(item["attention_mask"].sum())
    assert item["input_ids"][n - 1] == tok.bos_token_id
    short, _ = create_prompt_dataset(max_seq_len=8, **args)
    assert short[0]["attention_mask"].all() and short.stats["train"]["truncated"] == len(short)


# ------------------------------------------------------------------ sources and formats
def test_hh_sample_reads(tok, tmp_path):
    if not HH_SAMPLE.is_file():
        pytest.skip(f"HH-RLHF sample not present at {HH_SAMPLE}")
    with gzip.open(HH_SAMPLE, "rt", encoding="utf-8") as f:
        raw = [json.loads(line) for line in f]
    source = load_source(str(HH_SAMPLE))
    assert source.kind == "pair" and source.eval is None
    assert len(raw) - 10 <= len(source.train) == len(raw) - source.skipped
    for row in source.train[:200]:
        assert row.prompt.endswith("\n\nAssistant:") and row.prompt.startswith("\n\nHuman:")
        assert row.chosen != row.rejected
    # The split is lossless for the rows kept.
    originals = {(r["chosen"], r["rejected"]) for r in raw}
    assert all((r.prompt + r.chosen, r.prompt + r.rejected) in originals
               for r in source.train[:200])
    train, _ = create_prompt_dataset(0, [str(HH_SAMPLE)], "2,4,4", str(tmp_path), 2, 1234, tok,
                                     256)
    assert len(train) > 100


def test_split_conversation_pair():
    chosen = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: It is 4."
    rejected = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: It is 5."
    prompt, good, bad = split_conversation_pair(chosen, rejected)
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant:"
    assert (good, bad) == (" It is 4.", " It is 5.")


def _write_all_formats(root: Path, rows):
    """The same rows as jsonl, json, csv, parquet, jsonl.gz, json.gz and csv.gz files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": write_jsonl(root / "d.jsonl", rows),
             "jsonl.gz": write_jsonl(root / "d.jsonl.gz", rows)}
    (root / "d.json").write_text(json.dumps(rows), encoding="utf-8")
    paths["json"] = str(root / "d.json")
    columnar = {k: [r[k] for r in rows] for k in rows[0]}
    with gzip.open(root / "d.json.gz", "wt", encoding="utf-8") as f:
        json.dump(columnar, f)
    paths["json.gz (columnar)"] = str(root / "d.json.gz")
    for name, opener in (("d.csv", open), ("d.csv.gz", gzip.open)):
        with opener(root / name, "wt", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        paths[name[2:]] = str(root / name)
    pq.write_table(pa.Table.from_pylist(rows), root / "d.parquet")
    paths["parquet"] = str(root / "d.parquet")
    return paths


def test_local_file_formats_read_the_same(tmp_path):
    rows = dahoas_rows(30)
    expected = [(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    for kind, path in _write_all_formats(tmp_path, rows).items():
        source = load_source(path)
        assert source.kind == "pair" and source.eval is None, kind
        assert [(r.prompt, r.chosen, r.rejected) for r in source.train] == expected, kind


def test_folder_and_save_to_disk(tmp_path):
    import datasets

    folder = tmp_path / "folder"
    write_jsonl(folder / "train.jsonl", dahoas_rows(30, "a"))
    write_jsonl(folder / "test.jsonl", dahoas_rows(6, "b"))
    write_jsonl(folder / "notes.jsonl", dahoas_rows(3, "c"))  # ignored: train* files exist
    source = load_source(str(folder))
    assert (len(source.train), len(source.eval)) == (30, 6)

    flat = tmp_path / "flat"
    write_jsonl(flat / "part1.jsonl", dahoas_rows(10, "a"))
    write_jsonl(flat / "part2.jsonl.gz", dahoas_rows(5, "b"))
    source = load_source(str(flat))
    assert len(source.train) == 15 and source.eval is None

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(dahoas_rows(20, "a")),
                               "test": datasets.Dataset.from_list(dahoas_rows(4, "b"))})
    dd.save_to_disk(str(tmp_path / "disk"))
    source = load_source(str(tmp_path / "disk"))
    assert (len(source.train), len(source.eval)) == (20, 4)
    assert source.train[0].prompt == dahoas_rows(1, "a")[0]["prompt"]

    datasets.Dataset.from_list(dahoas_rows(12)).save_to_disk(str(tmp_path / "disk1"))
    source = load_source(str(tmp_path / "disk1"))
    assert len(source.train) == 12 and source.eval is None


def test_other_formats(tmp_path):
    hh = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello there", "rejected":
         "\n\nHuman: hi\n\nAssistant: go away"}])
    row = load_source(hh).train[0]
    assert (row.prompt, row.chosen, row.rejected) == \
        ("\n\nHuman: hi\n\nAssistant:", " hello there", " go away")

    webgpt = write_jsonl(tmp_path / "webgpt.jsonl", [
        {"question": {"full_text": "Why is the sky blue?"}, "answer_0": "Rayleigh [1].",
         "answer_1": "Magic.", "score_0": 1.0, "score_1": -1.0},
        {"question": {"full_text": "Tie?"}, "answer_0": "a", "answer_1": "b",
         "score_0": 0.0, "score_1": 0.0}])
    source = load_source(webgpt)
    assert source.skipped == 1 and len(source.train) == 1
    row = source.train[0]
    assert row.prompt == "\n\nHuman: Why is the sky blue?\n\nAssistant:"
    assert (row.chosen, row.rejected) == (" Rayleigh.", " Magic.")

    shp = write_jsonl(tmp_path / "shp.jsonl", [
        {"history": "Best pet?", "human_ref_A": "A cat.", "human_ref_B": "A rock.", "labels": 0}])
    row = load_source(shp).train[0]
    assert (row.chosen, row.rejected) == (" A rock.", " A cat.")

    sft = write_jsonl(tmp_path / "sft.jsonl", [
        {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "response": f" a{i}"} for i in range(20)])
    source = load_source(sft)
    assert source.kind == "sft" and source.train[0].rejected is None
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": f"doc {i}"} for i in range(5)])
    assert load_source(text).kind == "text"


def test_phase_requirements(tok, tmp_path):
    sft = write_jsonl(tmp_path / "sft.jsonl", [
        {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "response": f" a{i}"} for i in range(30)])
    args = dict(local_rank=0, data_split="2,4,4", output_path=str(tmp_path / "cache"),
                seed=1, tokenizer=tok, max_seq_len=32)
    train, _ = create_prompt_dataset(data_path=[sft], train_phase=1, **args)
    assert len(train) > 0
    train, _ = create_prompt_dataset(data_path=[sft], train_phase=3, **args)
    assert len(train) > 0
    with pytest.raises(UserInputError) as err:
        create_prompt_dataset(data_path=[sft], train_phase=2, **args)
    assert "not step 2" in one_line_error(err) and "sft.jsonl" in str(err.value)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": f"doc {i}"} for i in range(30)])
    with pytest.raises(UserInputError) as err:
        create_prompt_dataset(data_path=[text], train_phase=1, **args)
    assert "--unsupervised_dataset_name" in one_line_error(err)


def test_bad_rows_skipped_with_count(tmp_path, data_log):
    rows = dahoas_rows(10)
    rows[2] = {"prompt": "\n\nHuman: x\n\nAssistant:", "chosen": " y"}       # missing rejected
    rows[4] = dict(rows[4], chosen="   ")                                      # empty
    rows[6] = dict(rows[6], rejected=7)                                        # not a string
    lines = [json.dumps(r) for r in rows]
    lines[8] = "{not json"
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    source = load_source(path)
    assert len(source.train) == 6 and source.skipped == 4
    warning = next(r.getMessage() for r in data_log.records if "skipped" in r.getMessage())
    assert "skipped 4 of 10 rows" in warning and "rows 3, 5, 7, 9" in warning
    assert "bad.jsonl" in warning


def test_unusable_files_one_clear_error(tmp_path):
    cases = {
        "wrong.jsonl": ('{"a": 1, "b": "x"}\n', "needs columns prompt+chosen+rejected, or "
                        "chosen+rejected, or prompt+response, or text; found: a, b"),
        "empty.jsonl": ("", "empty"),
        "allbad.jsonl": ('{"prompt": "", "chosen": "", "rejected": ""}\n', "no usable row"),
        "garbage.jsonl": ("this is not json\nnor this\n", "not JSON lines"),
        "empty.csv": ("", "empty"),
        "wrongcols.csv": ("a,b\n1,2\n", "needs columns prompt+chosen+rejected, or "
                          "chosen+rejected, or prompt+response, or text; found: a, b"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
        with pytest.raises(UserInputError) as err:
            load_source(str(tmp_path / name))
        message = one_line_error(err)
        assert expected in message and name in message, message
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x81garbage")
    with pytest.raises(UserInputError) as err:
        load_source(str(tmp_path / "binary.jsonl"))
    assert "not UTF-8" in one_line_error(err)
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserInputError) as err:
        load_source(str(tmp_path / "fake.parquet"))
    assert "parquet" in one_line_error(err)
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(UserInputError) as err:
        load_source(str(tmp_path / "data.txt"))
    assert "unsupported file type" in one_line_error(err)
    with pytest.raises(UserInputError) as err:
        load_source(str(tmp_path / "missing.jsonl"))
    assert "no such file" in one_line_error(err)


def test_hub_name_offline_is_one_line_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserInputError) as err:
        load_source("dschat-tests/no-such-dataset", "--data_path")
    message = one_line_error(err)
    assert "--data_path dschat-tests/no-such-dataset" in message
    assert "download" in message and "local path" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__


# ------------------------------------------------------------------ split
def test_parse_data_split():
    assert parse_data_split("2,4,4") == pytest.approx((0.2, 0.4, 0.4))
    assert parse_data_split("10,0,0") == (1.0, 0.0, 0.0)
    for bad in ("2,4", "a,b,c", "0,0,0", "-1,1,1"):
        with pytest.raises(UserInputError, match="--data_split"):
            parse_data_split(bad)


def test_data_split_disjoint_reproducible_covering(tmp_path):
    rows = dahoas_rows(203)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    source = load_source(path)
    chunks = [phase_rows(source, "2,4,4", phase, seed=7) for phase in (1, 2, 3)]
    trains = [{r.prompt for r in tr} for tr, _ in chunks]
    evals = [{r.prompt for r in ev} for _, ev in chunks]
    for group in (trains, evals):
        assert all(not (a & b) for i, a in enumerate(group) for b in group[i + 1:])
    all_train, all_eval = set().union(*trains), set().union(*evals)
    assert not (all_train & all_eval)
    assert all_train | all_eval == {r["prompt"] for r in rows}
    assert len(all_eval) == round(0.1 * 203)
    assert [len(t) for t in trains] == [round(0.2 * 183), round(0.6 * 183) - round(0.2 * 183),
                                        183 - round(0.6 * 183)]
    again = [phase_rows(source, "2,4,4", phase, seed=7) for phase in (1, 2, 3)]
    assert again == chunks
    other = phase_rows(source, "2,4,4", 1, seed=8)
    assert other != chunks[0]
    # Index level: the three chunks are the seeded permutation cut in order.
    parts = [chunk_indices(50, (0.2, 0.4, 0.4), k, 3) for k in range(3)]
    assert torch.equal(torch.as_tensor(list(parts[0]) + list(parts[1]) + list(parts[2])),
                       torch.as_tensor(permutation(50, 3)))


def test_empty_chunk_names_data_split(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", dahoas_rows(20))
    with pytest.raises(UserInputError) as err:
        create_prompt_dataset(0, [path], "10,0,0", str(tmp_path / "c"), 2, 1, tok, 32)
    assert "--data_split 10,0,0" in one_line_error(err)


def test_blend_and_sft_only(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", dahoas_rows(50, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", dahoas_rows(30, "b"))
    sft = write_jsonl(tmp_path / "sft.jsonl", [
        {"prompt": f"\n\nHuman: s{i}\n\nAssistant:", "response": f" r{i}"} for i in range(20)])
    args = dict(local_rank=0, data_split="10,0,0", output_path=str(tmp_path / "c"), seed=1,
                tokenizer=tok, max_seq_len=32)
    train, evals = create_prompt_dataset(data_path=[a, b], train_phase=1, **args)
    assert (len(train), len(evals)) == (45 + 27, 5 + 3)
    train, evals = create_prompt_dataset(data_path=[a, b], train_phase=1,
                                         sft_only_data_path=[sft], **args)
    assert (len(train), len(evals)) == (45 + 27 + 18, 5 + 3 + 2)
    decoded = [tok.decode(train[i]["input_ids"]) for i in range(len(train))]
    assert any("Human: s" in d for d in decoded[:30]) and any("Human: a" in d for d in decoded)


# ------------------------------------------------------------------ step 3 limits
def test_no_prompt_fits(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", dahoas_rows(20))
    with pytest.raises(UserInputError) as err:
        create_prompt_dataset(0, [path], "2,4,4", str(tmp_path / "c"), 3, 1, tok, 4)
    message = one_line_error(err)
    assert "--max_prompt_seq_len 4" in message and "shortest is" in message
    assert "d.jsonl" in message


def test_long_prompts_dropped_not_truncated(tok, tmp_path):
    rows = dahoas_rows(40)
    for r in rows[::2]:
        r["prompt"] = r["prompt"].replace("what", "what " + "very " * 30)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, _ = create_prompt_dataset(0, [path], "0,0,1", str(tmp_path / "c"), 3, 1, tok, 24)
    assert 0 < len(train) < 36 and train.stats["train"]["too_long_prompts"] > 0
    assert all(train[i]["prompt_input_ids"].numel() <= 24 for i in range(len(train)))


def test_identical_pairs_skipped(tok, tmp_path):
    rows = dahoas_rows(20)
    for r in rows[:5]:
        r["rejected"] = r["chosen"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, evals = create_prompt_dataset(0, [path], "0,1,0", str(tmp_path / "c"), 2, 1, tok, 32)
    assert len(train) + len(evals) == 15


# ------------------------------------------------------------------ cache
def test_cache_hit_key_and_reload(tok, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", dahoas_rows(40))
    out = tmp_path / "cache"
    args = dict(local_rank=0, data_path=[path], data_split="2,4,4", output_path=str(out),
                train_phase=1, seed=1, tokenizer=tok)
    first, _ = create_prompt_dataset(max_seq_len=32, **args)
    assert first.cache_dir.parent == out and (first.cache_dir / "meta.json").is_file()

    def boom(*a, **k):
        raise AssertionError("cache miss: rebuilt")

    monkeypatch.setattr(data_datasets, "_build_prompt_payload", boom)
    second, _ = create_prompt_dataset(max_seq_len=32, **args)  # served from the cache
    assert second.cache_dir == first.cache_dir
    assert all(torch.equal(first[i]["input_ids"], second[i]["input_ids"])
               for i in range(len(first)))
    with pytest.raises(AssertionError, match="cache miss"):
        create_prompt_dataset(max_seq_len=33, **args)        # new key -> build
    with pytest.raises(AssertionError, match="cache miss"):
        create_prompt_dataset(max_seq_len=32, reload=True, **args)
    assert (first.cache_dir / "meta.json").is_file()         # failed rebuild keeps the old
    assert [p.name for p in out.iterdir()] == [first.cache_dir.name]  # no temp dirs left

    key = lambda **kw: prompt_cache_dir(**{**dict(  # noqa: E731
        data_path=[path], data_split="2,4,4", output_path=str(out), train_phase=1, seed=1,
        tokenizer=tok, max_seq_len=32), **kw})
    base = key()
    assert base == first.cache_dir
    for change in (dict(max_seq_len=64), dict(seed=2), dict(data_split="1,1,1"),
                   dict(train_phase=2), dict(end_of_conversation_token="<s>"),
                   dict(sft_only_data_path=[path])):
        assert key(**change) != base, change
    os.utime(path, ns=(1, 1))                                # file changed -> new key
    assert key() != base


# ------------------------------------------------------------------ ptx data
def test_unsupervised_blocks(tok, tmp_path):
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": f"document number {i} says hi"}
                                                 for i in range(50)])
    blocks = create_unsupervised_dataset([path], None, tok, 16, str(tmp_path / "c"), 1, 0)
    assert len(blocks) == blocks.stats["tokens"] // 16 > 10
    item = blocks[0]
    assert item["input_ids"].shape == (16,) and item["attention_mask"].all()
    assert torch.equal(item["labels"], item["input_ids"])
    assert tok.eos_token_id in torch.cat([blocks[i]["input_ids"] for i in range(len(blocks))])
    # Prompt/answer data works as ptx text too.
    bundled = create_unsupervised_dataset(BUNDLED_DATASET_NAME, None, tok, 64,
                                          str(tmp_path / "c"), 1, 0)
    assert len(bundled) > 100
    with pytest.raises(UserInputError, match="less than one block"):
        create_unsupervised_dataset([path], None, tok, 100000, str(tmp_path / "c"), 1, 0)
