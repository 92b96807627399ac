"""Row formats: detect a source's format from its columns and normalise each row.

Every row becomes a `Row`: a preference pair (prompt, chosen, rejected), an SFT example
(prompt, chosen) or plain text (unsupervised / ptx data). Formats seen in the wild:

    pair   prompt + chosen + rejected (+ response)          Dahoas/rm-static style
    pair   chosen + rejected whole conversations             Anthropic/hh-rlhf style
    pair   question + answer_0/1 + score_0/1                 openai/webgpt_comparisons
    pair   history + human_ref_A/B + labels                  stanfordnlp/SHP
    sft    prompt + response (or prompt + chosen)            no rejected answer
    text   text                                              ptx data

Prompts keep (or get) DS-Chat's "\\n\\nHuman: ...\\n\\nAssistant:" form; answers are the
text after it, normally starting with a space.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Optional

from dschat.utils.errors import UserInputError

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"

PAIR, SFT, TEXT = "pair", "sft", "text"
# What each kind can feed: step 2 needs a rejected answer; ptx data only needs text.
KIND_PHASES = {PAIR: (1, 2, 3), SFT: (1, 3), TEXT: ()}

EXPECTED_COLUMNS = ("prompt+chosen+rejected, or chosen+rejected, or prompt+response, "
                    "or text")


class Row(NamedTuple):
    """One normalised example. Pairs fill prompt/chosen/rejected, SFT rows prompt/chosen.

    `fields`: the record's other columns with scalar values (e.g. the reference "answer"
    of a verifiable task), for step 3's --reward_fn; None when there are none."""
    prompt: Optional[str] = None
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    text: Optional[str] = None
    fields: Optional[dict] = None

    def as_text(self) -> str:
        """The row as one document (ptx data): its text, or prompt + chosen answer."""
        return self.text if self.text is not None else self.prompt + self.chosen


class BadRow(Exception):
    """A row that cannot be used; the message is the reason (counted, not raised further)."""


@dataclass(frozen=True)
class Format:
    name: str
    kind: str
    columns: tuple[str, ...]          # all must be present for the format to apply
    normalise: Callable[[dict], Row]  # raises BadRow


# ------------------------------------------------------------------------- field checks
def field_str(record: dict, column: str) -> str:
    """The column's value as a non-empty string, else BadRow."""
    value = record.get(column)
    if value is None:
        raise BadRow(f"missing {column}")
    if not isinstance(value, str):
        raise BadRow(f"{column} is not a string")
    if not value.strip():
        raise BadRow(f"empty {column}")
    return value


def as_answer(text: str) -> str:
    """An answer as it follows "Assistant:" in DS-Chat's form: with one leading space."""
    return text if text[:1].isspace() else " " + text


def as_prompt(question: str) -> str:
    """A bare question in DS-Chat's prompt form."""
    return f"{HUMAN} {question.strip()}{ASSISTANT}"


def split_conversation_pair(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two whole conversations at the last "\\n\\nAssistant:" of their common prefix.

    Returns (prompt, chosen answer, rejected answer); the prompt ends with "Assistant:".
    """
    shared = len(os.path.commonprefix([chosen, rejected]))
    # rfind with end=shared only finds markers lying wholly inside the shared prefix.
    at = chosen.rfind(ASSISTANT, 0, shared)
    if at < 0:
        raise BadRow("chosen and rejected share no '\\n\\nAssistant:' turn")
    cut = at + len(ASSISTANT)
    prompt, good, bad = chosen[:cut], chosen[cut:], rejected[cut:]
    if not good.strip() or not bad.strip():
        raise BadRow("empty answer after the last shared '\\n\\nAssistant:'")
    return prompt, good, bad


# ------------------------------------------------------------------------- normalisers
def _prompt_chosen_rejected(r: dict) -> Row:
    return Row(field_str(r, "prompt"), field_str(r, "chosen"), field_str(r, "rejected"))


def _conversation_pair(r: dict) -> Row:
    return Row(*split_conversation_pair(field_str(r, "chosen"), field_str(r, "rejected")))


def _prompt_response(r: dict) -> Row:
    return Row(field_str(r, "prompt"), field_str(r, "response"))


def _prompt_chosen(r: dict) -> Row:
    return Row(field_str(r, "prompt"), field_str(r, "chosen"))


def _text(r: dict) -> Row:
    return Row(text=field_str(r, "text"))


_CITATION = re.compile(r" [\(\[][^\)\]]*?[\)\]]")


def _number(record: dict, column: str) -> float:
    value = record.get(column)
    if isinstance(value, str):  # CSV cells
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRow(f"{column} is not a number")
    return float(value)


def _webgpt(r: dict) -> Row:
    """openai/webgpt_comparisons: the higher-scored answer is chosen; ties are skipped."""
    question = r.get("question")
    if isinstance(question, dict):
        question = question.get("full_text")
    if not isinstance(question, str) or not question.strip():
        raise BadRow("missing question")
    s0, s1 = _number(r, "score_0"), _number(r, "score_1")
    if s0 == s1:
        raise BadRow("tied scores")
    a0, a1 = field_str(r, "answer_0"), field_str(r, "answer_1")
    good, bad = (a0, a1) if s0 > s1 else (a1, a0)
    # Answers cite sources as " [1]" / " (2)"; upstream strips them too.
    good, bad = _CITATION.sub("", good), _CITATION.sub("", bad)
    if not good.strip() or not bad.strip():
        raise BadRow("empty answer")
    return Row(as_prompt(question), as_answer(good), as_answer(bad))


def _shp(r: dict) -> Row:
    """stanfordnlp/SHP: labels == 1 means human_ref_A is preferred."""
    history = field_str(r, "history")
    a, b = field_str(r, "human_ref_A"), field_str(r, "human_ref_B")
    label = r.get("labels")
    label = int(label) if isinstance(label, str) and label.strip() in ("0", "1") else label
    if label not in (0, 1):
        raise BadRow("labels is not 0 or 1")
    good, bad = (a, b) if label == 1 else (b, a)
    return Row(as_prompt(history), as_answer(good), as_answer(bad))


# Checked in this order; the first whose columns are all present wins.
FORMATS: tuple[Format, ...] = (
    Format("prompt+chosen+rejected", PAIR, ("prompt", "chosen", "rejected"),
           _prompt_chosen_rejected),
    Format("webgpt", PAIR, ("question", "answer_0", "answer_1", "score_0", "score_1"), _webgpt),
    Format("shp", PAIR, ("history", "human_ref_A", "human_ref_B", "labels"), _shp),
    Format("chosen+rejected conversations", PAIR, ("chosen", "rejected"), _conversation_pair),
    Format("prompt+response", SFT, ("prompt", "response"), _prompt_response),
    Format("prompt+chosen", SFT, ("prompt", "chosen"), _prompt_chosen),
    Format("text", TEXT, ("text",), _text),
)


def detect_format(columns: Iterable[str]) -> Optional[Format]:
    """The first known format whose columns are all present, or None."""
    present = set(columns)
    for fmt in FORMATS:
        if present.issuperset(fmt.columns):
            return fmt
    return None


def require_format(columns: list[str], origin: str) -> Format:
    """`detect_format`, or a UserInputError naming `origin` and the columns found."""
    fmt = detect_format(columns)
    if fmt is None:
        found = ", ".join(columns) if columns else "no columns"
        raise UserInputError(f"{origin}: needs columns {EXPECTED_COLUMNS}; found: {found}")
    return fmt


# ------------------------------------------------------------------------- bad-row report
@dataclass
class SkipReport:
    """Rows skipped while normalising one file: counts per reason and the first row numbers."""
    origin: str
    total: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    first_rows: list[int] = field(default_factory=list)

    MAX_ROWS_SHOWN = 5

    @property
    def skipped(self) -> int:
        return sum(self.reasons.values())

    def add(self, row_number: int, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if len(self.first_rows) < self.MAX_ROWS_SHOWN:
            self.first_rows.append(row_number)

    def summary(self) -> str:
        why = "; ".join(f"{reason}: {n}" for reason, n in sorted(self.reasons.items()))
        rows = ", ".join(map(str, self.first_rows))
        more = ", ..." if self.skipped > len(self.first_rows) else ""
        return (f"{self.origin}: skipped {self.skipped} of {self.total} rows ({why}); "
                f"rows {rows}{more}")


def normalise_records(records: Iterable[tuple[int, object]], fmt: Format,
                      report: SkipReport) -> list[Row]:
    """Normalise (row number, record) pairs; bad ones are counted in `report`, not raised."""
    rows = []
    for number, record in records:
        report.total += 1
        if not isinstance(record, dict):
            report.add(number, "not an object" if record is not _UNREADABLE else "invalid JSON")
            continue
        try:
            row = fmt.normalise(record)
        except BadRow as bad:
            report.add(number, str(bad))
            continue
        extra = extra_fields(record, fmt.columns)
        rows.append(row._replace(fields=extra) if extra else row)
    return rows


_SCALARS = (str, int, float, bool)


def extra_fields(record: dict, used: tuple[str, ...]) -> Optional[dict]:
    """The record's columns its format does not read, scalar values only (nested values are
    left out: they would grow the step-3 cache and cannot be loaded with weights_only)."""
    extra = {k: v for k, v in record.items()
             if k not in used and isinstance(k, str) and (v is None or isinstance(v, _SCALARS))}
    return extra or None


# Stand-in record for a line that failed to parse (counted as a bad row).
_UNREADABLE = object()


def unreadable_record() -> object:
    return _UNREADABLE
