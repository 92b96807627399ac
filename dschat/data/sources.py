"""Where rows come from: resolve a `--data_path` entry and read it into normalised rows.

An entry may be
  - the bundled name `dschat/synthetic-assistant`;
  - a local file: .jsonl, .json, .parquet, .csv, each optionally .gz / .bz2 / .xz;
  - a local folder of such files: train* files are the train split, test* / eval* /
    valid* files the eval split; with no train* file every file is train data;
  - a folder written by `datasets.save_to_disk`;
  - a hub name, loaded with `datasets.load_dataset` (works offline only from the local
    HF cache). Known DS-Chat names (Dahoas/rm-static, ...) get their column conventions,
    also when a local path ends with that name.

Local files are read here rather than by `datasets.load_dataset("json", data_files=...)`:
with datasets 5.2 one unparseable line of a .jsonl fails the whole file with
"DatasetGenerationError: An error occurred while generating the dataset" and no line
number, where these readers skip the line, count it and name its row; the rows then go
through the same per-row checks as every other source.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from dschat.data import formats as F
from dschat.data.assets import BUNDLED_DATASET_NAME, bundled_dataset_path
from dschat.utils.errors import UserInputError
from dschat.utils.logging import get_logger

logger = get_logger("dschat.data")

DATA_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# JSON files of save_to_disk folders and hub repos that are metadata, not rows.
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
EVAL_SPLITS = ("test", "validation", "eval", "valid")


# ------------------------------------------------------------------------- named datasets
@dataclass(frozen=True)
class NamedDataset:
    """A dataset DS-Chat users pass by name, and how to read it."""
    name: str
    eval_split: Optional[str]          # its eval split on the hub; None: cut 9:1 from train
    format: Optional[F.Format] = None  # where column detection alone would misread it


def _gptj_pairwise(r: dict) -> F.Row:
    # Bare questions and answers: put them in DS-Chat's conversation form.
    return F.Row(F.as_prompt(F.field_str(r, "prompt")), F.as_answer(F.field_str(r, "chosen")),
                 F.as_answer(F.field_str(r, "rejected")))


def _yitingxie(r: dict) -> F.Row:
    # Prompts stop before "Assistant:"; answers start with it.
    prompt = F.field_str(r, "prompt")
    if not prompt.rstrip().endswith("Assistant:"):
        prompt = prompt.rstrip() + F.ASSISTANT
    answers = [F.field_str(r, c).split("Assistant:")[-1] for c in ("chosen", "rejected")]
    if not all(a.strip() for a in answers):
        raise F.BadRow("empty answer")
    return F.Row(prompt, *answers)


def _sharegpt(r: dict) -> F.Row:
    prompt = F.field_str(r, "prompt").replace("USER", "Human").replace("ASSISTANT", "Assistant")
    return F.Row(prompt, F.as_answer(F.field_str(r, "label")))


def _zhihu(r: dict) -> F.Row:
    return F.Row(F.as_prompt(F.field_str(r, "INSTRUCTION")),
                 F.as_answer(F.field_str(r, "RESPONSE")))


NAMED_DATASETS = {d.name: d for d in [
    NamedDataset("Dahoas/rm-static", "test"),
    NamedDataset("Dahoas/full-hh-rlhf", "test"),
    NamedDataset("Dahoas/synthetic-instruct-gptj-pairwise", None,
                 F.Format("gptj-pairwise", F.PAIR, ("prompt", "chosen", "rejected"),
                          _gptj_pairwise)),
    NamedDataset("yitingxie/rlhf-reward-datasets", "test",
                 F.Format("yitingxie", F.PAIR, ("prompt", "chosen", "rejected"), _yitingxie)),
    NamedDataset("Anthropic/hh-rlhf", "test"),
    NamedDataset("openai/webgpt_comparisons", None),
    NamedDataset("stanfordnlp/SHP", "validation"),
    NamedDataset("pvduy/sharegpt_alpaca_oa_vicuna_format", "test",
                 F.Format("sharegpt", F.SFT, ("prompt", "label"), _sharegpt)),
    NamedDataset("wangrui6/Zhihu-KOL", None,
                 F.Format("zhihu", F.SFT, ("INSTRUCTION", "RESPONSE"), _zhihu)),
]}


def named_dataset_for(entry: str) -> Optional[NamedDataset]:
    """The known dataset `entry` names, also as the tail of a local path (…/Dahoas/rm-static)."""
    if entry in NAMED_DATASETS:
        return NAMED_DATASETS[entry]
    tail = entry.replace(os.sep, "/").rstrip("/")
    for name, spec in NAMED_DATASETS.items():
        if tail.endswith("/" + name):
            return spec
    return None


# ------------------------------------------------------------------------- resolving
@dataclass(frozen=True)
class Resolved:
    """A `--data_path` entry resolved without reading it."""
    entry: str
    kind: str            # "file" | "folder" | "disk" (save_to_disk) | "hub"
    location: str        # absolute path, or the hub name
    named: Optional[NamedDataset]
    config_name: Optional[str] = None


def data_file_type(path: Path) -> Optional[tuple[str, Optional[str]]]:
    """(format, compression suffix) of a data file name, or None when not a data file."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes[-1] if suffixes and suffixes[-1] in COMPRESSIONS else None
    if compression:
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1] in DATA_SUFFIXES:
        return DATA_SUFFIXES[suffixes[-1]], compression
    return None


def _is_save_to_disk(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def resolve_entry(entry: str, flag: str = "--data_path",
                  config_name: Optional[str] = None) -> Resolved:
    """Decide what `entry` is (bundled, file, folder, save_to_disk folder, hub name)."""
    if not isinstance(entry, str) or not entry.strip():
        raise UserInputError(f"{flag}: empty entry {entry!r}")
    if entry == BUNDLED_DATASET_NAME:
        return Resolved(entry, "file", bundled_dataset_path(), None)
    named = named_dataset_for(entry)
    path = Path(entry).expanduser()
    if path.is_file():
        if data_file_type(path) is None:
            raise UserInputError(
                f"{flag} {entry}: unsupported file type; use .jsonl, .json, .parquet or .csv "
                f"(optionally .gz, .bz2 or .xz)")
        return Resolved(entry, "file", str(path.resolve()), named)
    if path.is_dir():
        kind = "disk" if _is_save_to_disk(path) else "folder"
        return Resolved(entry, kind, str(path.resolve()), named)
    if entry == "local/jsonfile":  # upstream's fixed local name: data/train.json, data/eval.json
        raise UserInputError(f"{flag} local/jsonfile: pass the folder holding train.json and "
                             f"eval.json (or any data file) as the path instead")
    if data_file_type(path) is not None or not _HUB_NAME.match(entry):
        raise UserInputError(f"{flag} {entry}: no such file or folder")
    return Resolved(entry, "hub", entry, named, config_name)


def fingerprint(resolved: Resolved) -> dict:
    """What identifies the data behind `resolved` for the cache key (no rows are read)."""
    if resolved.kind == "hub":
        return {"hub": resolved.location, "config": resolved.config_name}
    root = Path(resolved.location)
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root)))
    stats = []
    for p in files:
        st = p.stat()
        stats.append([str(p.relative_to(root)) if p != root else p.name, st.st_size,
                      st.st_mtime_ns])
    return {"kind": resolved.kind, "path": resolved.location, "files": stats}


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


# ------------------------------------------------------------------------- file readers
def _open_text(path: Path, compression: Optional[str]):
    opener = COMPRESSIONS.get(compression)
    if opener is None:
        return open(path, "r", encoding="utf-8", newline="")
    return opener(path, "rt", encoding="utf-8", newline="")


def _read_bytes(path: Path, compression: Optional[str]) -> bytes:
    opener = COMPRESSIONS.get(compression, open)
    with opener(path, "rb") as f:
        return f.read()


def _jsonl_records(path: Path, compression) -> tuple[list[str], list]:
    records, bad_lines = [], 0
    with _open_text(path, compression) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad_lines += 1
                records.append(F.unreadable_record())
    if records and bad_lines == len(records):
        raise UserInputError(f"{path}: not JSON lines (no line parses as JSON)")
    return _columns_of(records), list(enumerate(records, 1))


def _json_records(path: Path, compression) -> tuple[list[str], list]:
    with _open_text(path, compression) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg.startswith("Extra data"):  # JSON lines saved as .json
            return _jsonl_records(path, compression)
        raise UserInputError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if lists and len(lists) == len(data) and len({len(v) for v in lists}) == 1:
            # Columnar: {"prompt": [...], "chosen": [...]}
            data = [dict(zip(data, values)) for values in zip(*data.values())]
        elif len(lists) == 1 and all(isinstance(x, dict) for x in lists[0]):
            data = lists[0]  # {"data": [{...}, ...]}
        else:
            data = [data]
    if not isinstance(data, list):
        raise UserInputError(f"{path}: JSON must hold a list of rows, not {type(data).__name__}")
    return _columns_of(data), list(enumerate(data, 1))


def _csv_records(path: Path, compression) -> tuple[list[str], list]:
    csv.field_size_limit(1 << 30)  # whole conversations can be long
    with _open_text(path, compression) as f:
        reader = csv.DictReader(f)
        records = list(reader)
        columns = [c for c in (reader.fieldnames or []) if c]
    return columns, list(enumerate(records, 1))


def _parquet_records(path: Path, compression) -> tuple[list[str], list]:
    import pyarrow.parquet as pq

    try:
        source = io.BytesIO(_read_bytes(path, compression)) if compression else str(path)
        table = pq.read_table(source)
    except Exception as err:  # pyarrow raises several types for a bad file
        raise UserInputError(f"{path}: not a readable parquet file "
                             f"({_one_line(err)})") from None
    return list(table.column_names), list(enumerate(table.to_pylist(), 1))


_READERS = {"jsonl": _jsonl_records, "json": _json_records, "csv": _csv_records,
            "parquet": _parquet_records}


def _columns_of(records: list) -> list[str]:
    """Union of the keys of the dict records, in first-seen order."""
    seen: dict[str, None] = {}
    for record in records:
        if isinstance(record, dict):
            for key in record:
                seen.setdefault(key, None)
    return list(seen)


def read_records(path: Path) -> tuple[list[str], list]:
    """(columns, [(row number, record), ...]) of one local data file."""
    kind, compression = data_file_type(path)
    try:
        return _READERS[kind](path, compression)
    except UnicodeDecodeError:
        raise UserInputError(f"{path}: not UTF-8 text") from None
    except (OSError, EOFError, lzma.LZMAError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise UserInputError(f"{path}: cannot read it ({_one_line(err)})") from None
    except csv.Error as err:
        raise UserInputError(f"{path}: not valid CSV ({_one_line(err)})") from None


def _one_line(err: BaseException, limit: int = 200) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------- loaded sources
@dataclass
class Source:
    """The rows of one `--data_path` entry, normalised."""
    entry: str
    kind: str                           # formats.PAIR | SFT | TEXT
    train: list[F.Row]
    eval: Optional[list[F.Row]]         # None: the source has only a train split
    formats: list[str] = field(default_factory=list)
    skipped: int = 0


def _normalise(columns: list[str], records, origin: str, named: Optional[NamedDataset]):
    """Rows of one file / split, with bad rows logged; errors when none is usable."""
    if not records:
        raise UserInputError(f"{origin}: is empty (no rows)")
    fmt = named.format if named and named.format else None
    if fmt is None or not set(fmt.columns) <= set(columns):
        fmt = F.require_format(columns, origin)
    report = F.SkipReport(origin)
    rows = F.normalise_records(records, fmt, report)
    if not rows:
        raise UserInputError(
            f"{origin}: no usable row in {report.total} ({fmt.name} format; "
            + "; ".join(f"{r}: {n}" for r, n in sorted(report.reasons.items())) + ")")
    if report.skipped:
        logger.warning(report.summary())
    return fmt, rows, report.skipped


def _merge_kind(kinds: list[str], origin: str) -> str:
    """A source mixing pair and SFT files acts as SFT data; text mixes with nothing."""
    unique = set(kinds)
    if len(unique) == 1:
        return kinds[0]
    if F.TEXT in unique:
        raise UserInputError(f"{origin}: mixes text-only files with prompt/answer files")
    return F.SFT


def _split_of(rel: Path) -> Optional[str]:
    """'train' / 'eval' from a file's name (or its folders' names), else None."""
    for part in [rel.name, *reversed(rel.parent.parts)]:
        low = part.lower()
        if low.startswith("train"):
            return "train"
        if low.startswith(("test", "eval", "valid")):
            return "eval"
    return None


def _load_files(resolved: Resolved, files: list[Path], root: Optional[Path]):
    """Read files into (train rows, eval rows or None, kinds, formats, skipped)."""
    groups: dict[str, list[Path]] = {"train": [], "eval": []}
    if root is None:
        groups["train"] = files
    else:
        labelled = {p: _split_of(p.relative_to(root)) for p in files}
        if any(split == "train" for split in labelled.values()):
            for p, split in labelled.items():
                if split is None:
                    logger.warning(f"{p}: ignored (neither train* nor test*/eval*/valid* while "
                                   f"{root} has train* files)")
                else:
                    groups[split].append(p)
        else:
            groups["train"] = files
    out = {"train": [], "eval": []}
    kinds, fmts, skipped = [], [], 0
    for split, paths in groups.items():
        for path in paths:
            columns, records = read_records(path)
            fmt, rows, n_bad = _normalise(columns, records, str(path), resolved.named)
            out[split].extend(rows)
            kinds.append(fmt.kind)
            fmts.append(fmt.name)
            skipped += n_bad
    return out["train"], (out["eval"] if groups["eval"] else None), kinds, fmts, skipped


def _data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and not _hidden(p.relative_to(folder))
                  and p.name not in METADATA_FILES and data_file_type(p) is not None)


def _load_hub(resolved: Resolved, flag: str):
    """`datasets.load_dataset(name)`, failing in one line when it cannot be reached."""
    import datasets

    try:
        return datasets.load_dataset(resolved.location, resolved.config_name)
    except Exception as err:  # offline, missing, gated, ...: all end the same way for users
        offline = any(os.environ.get(v, "0") not in ("0", "", "false", "False")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        why = "offline mode, not in the local cache" if offline else _one_line(err, 160)
        raise UserInputError(
            f"{flag} {resolved.entry}: cannot load it from the Hugging Face hub ({why}); "
            f"download it where there is network, e.g. datasets.load_dataset("
            f"{resolved.location!r}).save_to_disk(DIR), and pass the local path DIR "
            f"instead") from None


def _hf_split_records(ds, origin: str, named: Optional[NamedDataset]):
    """Normalise one `datasets.Dataset` split."""
    columns = list(ds.column_names)
    fmt = named.format if named and named.format else None
    if fmt is None or not set(fmt.columns) <= set(columns):
        fmt = F.require_format(columns, origin)
    # Only the needed columns: converting whole rows to Python is the slow part.
    ds = ds.select_columns(list(fmt.columns))
    return _normalise(columns, list(enumerate(ds, 1)), origin, named)


def _load_hf(resolved: Resolved, obj, origin: str):
    """Rows of a `datasets` Dataset or DatasetDict (from the hub or load_from_disk)."""
    import datasets

    if isinstance(obj, datasets.Dataset):
        fmt, rows, skipped = _hf_split_records(obj, origin, resolved.named)
        return rows, None, [fmt.kind], [fmt.name], skipped
    splits = list(obj.keys())
    if "train" not in obj:
        raise UserInputError(f"{origin}: has no 'train' split (splits: {', '.join(splits)})")
    preferred = [resolved.named.eval_split] if resolved.named and resolved.named.eval_split else []
    eval_name = next((s for s in preferred + list(EVAL_SPLITS) if s in obj), None)
    fmt, train, skipped = _hf_split_records(obj["train"], f"{origin} [train]", resolved.named)
    kinds, fmts, evals = [fmt.kind], [fmt.name], None
    if eval_name is not None:
        efmt, evals, e_skipped = _hf_split_records(obj[eval_name], f"{origin} [{eval_name}]",
                                                   resolved.named)
        kinds.append(efmt.kind)
        fmts.append(efmt.name)
        skipped += e_skipped
    return train, evals, kinds, fmts, skipped


def load_source(entry: str, flag: str = "--data_path",
                config_name: Optional[str] = None) -> Source:
    """Read one `--data_path` entry into normalised rows (see the module docstring)."""
    resolved = resolve_entry(entry, flag, config_name)
    origin = f"{flag} {entry}"
    if resolved.kind == "file":
        loaded = _load_files(resolved, [Path(resolved.location)], None)
    elif resolved.kind == "folder":
        files = _data_files(Path(resolved.location))
        if not files:
            raise UserInputError(
                f"{origin}: folder has no data files (.jsonl, .json, .parquet, .csv, "
                f"optionally .gz/.bz2/.xz)")
        loaded = _load_files(resolved, files, Path(resolved.location))
    elif resolved.kind == "disk":
        import datasets

        try:
            obj = datasets.load_from_disk(resolved.location)
        except Exception as err:
            raise UserInputError(f"{origin}: cannot load this save_to_disk folder "
                                 f"({_one_line(err)})") from None
        loaded = _load_hf(resolved, obj, origin)
    else:
        loaded = _load_hf(resolved, _load_hub(resolved, flag), origin)
    train, evals, kinds, fmts, skipped = loaded
    return Source(entry, _merge_kind(kinds, origin), train, evals, fmts, skipped)


def iter_entries(entries) -> Iterator[str]:
    """`--data_path` values as a list (a single string is one entry)."""
    if isinstance(entries, str):
        yield entries
    else:
        yield from entries
