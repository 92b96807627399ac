"""Conversations as the model expects them: the tokenizer's chat template, or DS-Chat's text.

Every dataset row holds DS-Chat's text ("\\n\\nHuman: ...\\n\\nAssistant: ..."; multi-turn HH
conversations too). With `--chat_template auto` (the default) and a tokenizer that has a
chat template, that text is parsed into user/assistant messages and rendered by the
template: prompts end with the template's generation prompt, answers with the template's
end-of-turn marker (SmolLM2's `<|im_end|>`), which step 1 trains, step 2 scores at and step
3 stops at. `--chat_template none`, or a tokenizer without a template, keeps the raw text,
as upstream trains on; there an answer ends at the end-of-conversation token, and step 3
also stops an answer at `--stop_strings` (default "\\n\\nHuman:": a model that starts the
user's next turn has finished its own).
"""
from __future__ import annotations

import hashlib
import re
from typing import Optional

from dschat.data.formats import ASSISTANT, HUMAN
from dschat.utils.errors import UserInputError

CHAT_TEMPLATE_CHOICES = ("auto", "none")
DEFAULT_STOP_STRINGS = (HUMAN,)
_TURN = re.compile(f"({re.escape(HUMAN)}|{re.escape(ASSISTANT)})")
_SENTINEL = "\u2063dschat-answer\u2063"


def to_messages(text: str) -> list[dict]:
    """DS-Chat text -> chat messages in order. Text before the first marker joins the first
    user turn; a final empty "Assistant:" (a prompt awaiting its answer) gives no message."""
    parts = _TURN.split(text)
    messages, lead = [], parts[0].strip()
    for marker, content in zip(parts[1::2], parts[2::2]):
        role = "user" if marker == HUMAN else "assistant"
        content = content.strip()
        if role == "user" and lead:
            content, lead = f"{lead}\n{content}".strip(), ""
        if messages and messages[-1]["role"] == role:  # two turns of one speaker in a row: one turn
            messages[-1]["content"] = f"{messages[-1]['content']}\n{content}".strip()
        else:
            messages.append({"role": role, "content": content})
    if lead:
        messages.insert(0, {"role": "user", "content": lead})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


class ChatFormat:
    """How one tokenizer sees conversations under `--chat_template`.

    `prompt(text)` / `conversation(prompt, answer)` give the text to tokenise (encode it
    with `add_special_tokens=self.add_special_tokens`); `stop_token_ids` and `stop_strings`
    end generated answers (besides eos); `fingerprint` goes into data cache keys.
    """

    def __init__(self, tokenizer, mode: str = "auto", end_of_conversation: str = "",
                 stop_strings: Optional[tuple[str, ...]] = None, flag: str = "--chat_template"):
        if mode not in CHAT_TEMPLATE_CHOICES:
            raise UserInputError(f"{flag} {mode!r}: expected one of {', '.join(CHAT_TEMPLATE_CHOICES)}")
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) if mode == "auto" else None
        self.uses_template = bool(self.template)
        self.add_special_tokens = not self.uses_template  # the template writes its own bos etc.
        if self.uses_template:
            self.turn_end = self._template_turn_end(flag)
            self.stop_strings = tuple(stop_strings) if stop_strings is not None else ()
        else:
            self.turn_end = end_of_conversation
            self.stop_strings = tuple(stop_strings) if stop_strings is not None else DEFAULT_STOP_STRINGS
        ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        turn_end_id = _single_token_id(tokenizer, self.turn_end)
        if turn_end_id is not None and turn_end_id not in ids:
            ids.append(turn_end_id)
        self.stop_token_ids = tuple(ids)

    @property
    def fingerprint(self) -> str:
        if not self.uses_template:
            return "none"
        return "template:" + hashlib.sha256(self.template.encode()).hexdigest()[:16]

    def describe(self) -> str:
        if self.uses_template:
            return f"the tokenizer's chat template (answers end with {self.turn_end!r})"
        return (f"DS-Chat's raw text (answers end with {self.turn_end!r}; step 3 also stops at "
                f"{list(self.stop_strings)})")

    # ---------------------------------------------------------------------------- render
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja errors of the tokenizer's own template
            raise UserInputError(f"--chat_template auto: the tokenizer's chat template failed on a "
                                 f"conversation of {len(messages)} messages ({type(e).__name__}: "
                                 f"{str(e)[:200]}); pass --chat_template none") from None

    def _template_turn_end(self, flag: str) -> str:
        """What the template writes after an assistant message's content, trailing
        whitespace dropped (ChatML: "<|im_end|>"); the eos token when it writes nothing."""
        text = self._render([{"role": "user", "content": "u"},
                             {"role": "assistant", "content": _SENTINEL}], False)
        if _SENTINEL not in text:
            raise UserInputError(f"{flag} auto: the tokenizer's chat template drops the assistant's "
                                 "message; pass --chat_template none")
        end = text.split(_SENTINEL, 1)[1].rstrip()
        return end or (self.tokenizer.eos_token or "")

    def prompt(self, text: str) -> str:
        """A prompt as the model sees it before its answer."""
        if not self.uses_template:
            return text
        return self._render(to_messages(text), True)

    def conversation(self, prompt: str, answer: str, end_of_conversation: str = "") -> str:
        """Prompt + answer, ended by the end-of-turn marker (raw text: + `end_of_conversation`)."""
        if not self.uses_template:
            return prompt + answer + end_of_conversation
        messages = to_messages(prompt)
        head = self._render(messages, True)
        full = self._render(messages + [{"role": "assistant", "content": answer.strip()}], False)
        if not full.startswith(head):
            raise UserInputError("--chat_template auto: the tokenizer's template renders a prompt that is "
                                 "not the start of the same conversation with its answer; pass "
                                 "--chat_template none")
        cut = full.rfind(self.turn_end) if self.turn_end else -1
        return full[:cut + len(self.turn_end)] if cut >= len(head) else full.rstrip()

    def answer_length(self, ids: list[int], pad_id: Optional[int]) -> int:
        """How many of a generated answer's `ids` belong to it: up to and including the first
        stop token (eos, end of turn); else up to the first pad; and with stop strings only
        the tokens before the first one begins (`stop_string_cut`)."""
        n = len(ids)
        for i, t in enumerate(ids):
            if t in self.stop_token_ids:
                n = i + 1
                break
            if t == pad_id:
                n = i
                break
        cut = self.stop_string_cut(ids[:n])
        return n if cut is None else cut

    def stop_string_cut(self, ids: list[int]) -> Optional[int]:
        """The number of leading `ids` whose text ends before the first stop string begins
        (a stop string is the start of the user's next turn, not part of the answer); None
        when no stop string occurs."""
        if not self.stop_strings or not ids:
            return None
        decode = self.tokenizer.decode
        text = decode(ids)
        found = [p for p in (text.find(s) for s in self.stop_strings) if p >= 0]
        if not found:
            return None
        start = min(found)
        lo, hi = 0, len(ids)  # binary search: the most tokens whose text stays before `start`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(decode(ids[:mid])) <= start:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _single_token_id(tokenizer, text: str) -> Optional[int]:
    """The id of `text` when it is one token of the vocabulary, else None."""
    if not text:
        return None
    ids = tokenizer.convert_tokens_to_ids([text])
    unk = getattr(tokenizer, "unk_token_id", None)
    if ids and ids[0] is not None and ids[0] != unk:
        return int(ids[0])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None
