"""Chat templates and stop strings (dschat.data.chat) on a tiny tokenizer with a template
(the bundled one plus a ChatML template, SmolLM2's form) and on one without (the bundled one)."""
import json

import pytest
import torch
from transformers import AutoTokenizer

from dschat.data import create_prompt_dataset, prompt_cache_dir
from dschat.data.assets import bundled_tokenizer_path
from dschat.data.chat import ChatFormat, to_messages

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
HH = ("\n\nHuman: What is 2 plus 2?\n\nAssistant: It is 4.\n\nHuman: And 3 plus 3?"
      "\n\nAssistant:")


@pytest.fixture(scope="module")
def plain():
    return AutoTokenizer.from_pretrained(bundled_tokenizer_path())


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    folder = tmp_path_factory.mktemp("chatml-tokenizer")
    tok.save_pretrained(folder)  # a real tokenizer folder, as a model folder would hold it
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [{"chosen": HH + " It is 6.", "rejected": HH + " It is 7."},
            {"prompt": "\n\nHuman: Name a colour.\n\nAssistant:", "chosen": " Blue.", "rejected": " Seven."}] * 20
    path = tmp_path_factory.mktemp("chat-data") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_ds_chat_text_becomes_messages():
    assert to_messages(HH) == [{"role": "user", "content": "What is 2 plus 2?"},
                               {"role": "assistant", "content": "It is 4."},
                               {"role": "user", "content": "And 3 plus 3?"}]
    assert to_messages(HH + " It is 6.")[-1] == {"role": "assistant", "content": "It is 6."}
    # text before the first marker joins the first user turn; repeated speakers merge
    assert to_messages("Context.\n\nHuman: Q1\n\nHuman: Q2\n\nAssistant:") == [
        {"role": "user", "content": "Context.\nQ1\nQ2"}]


def test_template_renders_prompts_and_answers_ending_at_the_turn_end(templated):
    chat = ChatFormat(templated, "auto")
    assert chat.uses_template and chat.turn_end == "<|im_end|>" and not chat.add_special_tokens
    prompt = chat.prompt(HH)
    assert prompt == ("<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
                      "<|im_start|>user\nAnd 3 plus 3?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.conversation(HH, " It is 6.") == prompt + "It is 6.<|im_end|>"
    im_end = templated.convert_tokens_to_ids("<|im_end|>")
    assert chat.stop_token_ids == (templated.eos_token_id, im_end)
    assert chat.stop_strings == ()
    assert ChatFormat(templated, "none").fingerprint == "none" != chat.fingerprint


def test_no_template_keeps_raw_text_and_stops_at_the_next_human_turn(plain, templated):
    for chat in (ChatFormat(plain, "auto", plain.eos_token), ChatFormat(templated, "none", plain.eos_token)):
        assert not chat.uses_template and chat.add_special_tokens
        assert chat.prompt(HH) == HH
        assert chat.conversation(HH, " It is 6.", plain.eos_token) == HH + " It is 6." + plain.eos_token
        assert chat.stop_strings == ("\n\nHuman:",) and chat.stop_token_ids == (plain.eos_token_id,)
    assert ChatFormat(plain, "auto", stop_strings=("###",)).stop_strings == ("###",)


def test_datasets_of_all_three_steps_use_the_template(templated, data, tmp_path):
    args = dict(local_rank=0, data_path=[data], data_split="1,1,1", output_path=str(tmp_path), seed=1,
                tokenizer=templated, chat_template="auto")
    im_end = templated.convert_tokens_to_ids("<|im_end|>")
    sft, _ = create_prompt_dataset(train_phase=1, max_seq_len=96, **args)
    for i in range(len(sft)):
        item = sft[i]
        n = int(item["attention_mask"].sum())
        assert item["input_ids"][n - 1] == im_end, "step 1 trains the end-of-turn token"
        assert (item["labels"][:n] == item["input_ids"][:n]).all()
        text = templated.decode(item["input_ids"][:n])
        assert text.startswith("<|im_start|>user\n") and "Human:" not in text
    pairs, _ = create_prompt_dataset(train_phase=2, max_seq_len=96, **args)
    for side in ("chosen", "rejected"):
        n = int(pairs[0][f"{side}_attention_mask"].sum())
        assert pairs[0][f"{side}_input_ids"][n - 1] == im_end, "step 2 scores at the end-of-turn token"
    prompts, _ = create_prompt_dataset(train_phase=3, max_seq_len=96, **args)
    tail = templated("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for i in range(len(prompts)):
        assert prompts[i]["prompt_input_ids"][-len(tail):].tolist() == tail
    # the raw-text cache keeps its old key; the template gets its own
    key = dict(data_path=[data], data_split="1,1,1", output_path=str(tmp_path), train_phase=1, seed=1,
               tokenizer=templated, max_seq_len=96)
    assert prompt_cache_dir(**key) == prompt_cache_dir(**key, chat_template="none") \
        != prompt_cache_dir(**key, chat_template="auto")


def test_template_errors_are_one_line(templated):
    bad = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    bad.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(Exception) as err:
        ChatFormat(bad, "auto")
    assert "--chat_template none" in str(err.value)
    with pytest.raises(Exception, match="--chat_template 'x'"):
        ChatFormat(templated, "x")


def test_answer_length_keeps_the_stop_token_and_drops_a_stop_string(plain, templated):
    raw = ChatFormat(plain, "auto", plain.eos_token)
    pad = plain.pad_token_id
    ids = plain(" It is 6.", add_special_tokens=False)["input_ids"]
    assert raw.answer_length(ids + [plain.eos_token_id, pad, pad], pad) == len(ids) + 1
    assert raw.answer_length(ids + [pad, pad], pad) == len(ids)
    ran_on = ids + plain("\n\nHuman: And then?", add_special_tokens=False)["input_ids"]
    assert plain.decode(ran_on[:raw.answer_length(ran_on, pad)]) == " It is 6."
    assert ChatFormat(plain, "auto", stop_strings=()).answer_length(ran_on, pad) == len(ran_on)
    chat = ChatFormat(templated, "auto")
    im_end = templated.convert_tokens_to_ids("<|im_end|>")
    ids = templated("It is 6.", add_special_tokens=False)["input_ids"]
    assert chat.answer_length(ids + [im_end, 5, 6], templated.pad_token_id) == len(ids) + 1


def test_step3_answer_mask_stops_at_any_stop_id_and_before_a_stop_string(plain):
    from dschat.rlhf.trainer import answer_mask

    chat = ChatFormat(plain, "auto", plain.eos_token)
    pad, eos = plain.pad_token_id, plain.eos_token_id
    answer = plain(" It is 6.", add_special_tokens=False)["input_ids"]
    turn = plain("\n\nHuman: more", add_special_tokens=False)["input_ids"]
    width = len(answer) + len(turn) + 2
    rows = [answer + turn + [pad, pad],                         # ran on into the user's turn
            answer + [eos] + [pad] * (width - len(answer) - 1),  # ended at eos
            answer + [7] + [pad] * (width - len(answer) - 1)]    # ended at a second stop id
    mask = answer_mask(torch.tensor(rows), [eos, 7], pad, chat)
    n = len(answer)
    assert mask.tolist() == [[1] * n + [0] * (width - n), [1] * (n + 1) + [0] * (width - n - 1),
                             [1] * (n + 1) + [0] * (width - n - 1)]
    assert answer_mask(torch.tensor(rows), [eos, 7], pad)[0].sum() == n + len(turn)  # no chat: no cut
