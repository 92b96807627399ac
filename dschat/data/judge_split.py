"""Preference data cut for a run that is judged by a reward model the policy never sees.

    python -m dschat.data.judge_split --data_path HH.jsonl.gz --out DIR [--eval_fraction 0.1 --seed 1234]

All rows of the `--data_path` entries (their train and eval splits together) are grouped by
prompt, so no prompt lands on both sides of a cut. A seeded permutation of the groups gives
`eval_fraction` of them to a held-out set; the rest are cut in two halves:

    DIR/policy/train.jsonl   the policy's half: step 1 (chosen answers), step 2 (the reward
                             model PPO optimises) and step 3's prompts
    DIR/judge/train.jsonl    the judge's half: only the judge reward model trains on it
    DIR/policy/eval.jsonl    the held-out pairs and prompts (the same rows in both folders):
    DIR/judge/eval.jsonl     both reward models' accuracy and the policies' held-out answers
    DIR/split.json           counts, the inputs and the seed

Each folder is a `--data_path` (train* / eval* files are its splits); pass `--data_split
1,0,0`, `0,1,0` or `0,0,1` to give a step all of a folder. The policy reward model's
reward gain that the judge does not confirm is reward hacking.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dschat.data.formats import Row
from dschat.data.sources import iter_entries, load_source
from dschat.data.split import permutation
from dschat.utils.errors import UserInputError

logger = logging.getLogger(__name__)
HALVES = ("policy", "judge")


def group_by_prompt(rows: list[Row]) -> list[list[Row]]:
    """Rows with the same prompt, as groups in first-seen order."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.prompt, []).append(row)
    return list(groups.values())


def split_groups(groups: list, eval_fraction: float, seed: int) -> dict[str, list]:
    """{"eval", "policy", "judge": groups}: a seeded permutation, eval first, then two halves."""
    if not 0 < eval_fraction < 1:
        raise UserInputError(f"--eval_fraction {eval_fraction}: expected a number between 0 and 1")
    order = permutation(len(groups), seed)
    n_eval = max(1, int(round(eval_fraction * len(groups))))
    rest = order[n_eval:]
    half = (len(rest) + 1) // 2
    parts = {"eval": order[:n_eval], "policy": rest[:half], "judge": rest[half:]}
    if any(len(v) == 0 for v in parts.values()):
        raise UserInputError(f"{len(groups)} distinct prompts are too few to cut into held-out, "
                             "policy and judge sets")
    return {name: [groups[int(i)] for i in idx] for name, idx in parts.items()}


def _write(path: Path, groups: list[list[Row]]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for group in groups:
            for row in group:
                f.write(json.dumps({"prompt": row.prompt, "chosen": row.chosen, "rejected": row.rejected}) + "\n")
                count += 1
    return count


def prepare(data_path, out_dir: str, eval_fraction: float = 0.1, seed: int = 1234) -> dict:
    """Write the split (see the module docstring); an existing split made from the same
    inputs is kept as it is. Returns the contents of DIR/split.json."""
    out = Path(out_dir)
    entries = list(iter_entries(data_path))
    request = {"data_path": entries, "eval_fraction": eval_fraction, "seed": seed}
    marker = out / "split.json"
    if marker.is_file():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in request} == request:
            return done
    rows: list[Row] = []
    for entry in entries:
        source = load_source(entry, "--data_path")
        if source.kind != "pair":
            raise UserInputError(f"--data_path {entry}: a judge split needs preference pairs "
                                 f"(prompt, chosen, rejected); this source has {source.kind} rows")
        rows += source.train + (source.eval or [])
    parts = split_groups(group_by_prompt(rows), eval_fraction, seed)
    summary = dict(request, prompts={k: len(v) for k, v in parts.items()}, rows={})
    for half in HALVES:
        summary["rows"][half] = _write(out / half / "train.jsonl", parts[half])
        summary["rows"]["eval"] = _write(out / half / "eval.jsonl", parts["eval"])
    summary["folders"] = {half: str(out / half) for half in HALVES}
    marker.write_text(json.dumps(summary, indent=2))
    logger.info(f"judge split of {', '.join(entries)} in {out}: {summary['prompts']} prompts, "
                f"{summary['rows']} rows")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", nargs="+", required=True, help="Preference data (any --data_path form).")
    p.add_argument("--out", required=True, help="Folder to write policy/, judge/ and split.json into.")
    p.add_argument("--eval_fraction", type=float, default=0.1, help="Share of distinct prompts held out.")
    p.add_argument("--seed", type=int, default=1234, help="Seed of the permutation of prompts.")
    args = p.parse_args(argv)
    print(json.dumps(prepare(args.data_path, args.out, args.eval_fraction, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    from dschat.utils.run import main_guard
    main_guard(main)
