#!/usr/bin/env python
"""Generate the bundled demo assets: the synthetic-assistant dataset and its BPE tokenizer.

    python scripts/make_demo_assets.py            # (re)write dschat/assets/{data,tokenizer}
    python scripts/make_demo_assets.py --check    # regenerate into a temp dir, compare bytes
    python scripts/make_demo_assets.py --out DIR  # write into DIR/{data,tokenizer}

Everything is seeded, so the output is byte-identical between runs (`--check` and
tests/test_data.py hold us to that). The dataset is a small assistant task a tiny model
(4 layers, hidden 128) learns on CPU in minutes: arithmetic on small numbers, comparisons,
spelling, and facts from the tables below. `chosen` is the correct, polite answer in a short
template; `rejected` is a wrong answer in the same template, or a rude one, so a reward model
has something to separate. Prompts use DS-Chat's "\\n\\nHuman: ...\\n\\nAssistant:" form
and answers start with a space.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import sys
import tempfile
from pathlib import Path

# One rayon thread: the BPE trainer's result must not depend on thread scheduling.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "dschat" / "assets"
DATA_FILE = Path("data") / "synthetic-assistant.jsonl"
TOKENIZER_DIR = Path("tokenizer")

SEED = 20261129
NUM_ROWS = 4000
VOCAB_SIZE = 1024
# Ids 0..3, in this order (docs/CONVENTIONS.md).
SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<s>", "<unk>"]

# ---------------------------------------------------------------------------- tables
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "Russia": "Moscow", "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia",
    "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ghana": "Accra", "Morocco": "Rabat",
    "Greece": "Athens", "Turkey": "Ankara", "Poland": "Warsaw", "Sweden": "Stockholm",
    "Norway": "Oslo", "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Switzerland": "Bern", "Australia": "Canberra",
    "New Zealand": "Wellington", "South Korea": "Seoul", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Iran": "Tehran", "Cuba": "Havana",
    "the United Kingdom": "London", "the United States": "Washington",
}

# (question subject, answer subject, colour)
COLOURS = [
    ("the sky", "The sky", "blue"), ("grass", "Grass", "green"),
    ("a banana", "A banana", "yellow"), ("snow", "Snow", "white"),
    ("a tomato", "A tomato", "red"), ("coal", "Coal", "black"),
    ("a lemon", "A lemon", "yellow"), ("an orange", "An orange", "orange"),
    ("a strawberry", "A strawberry", "red"), ("milk", "Milk", "white"),
    ("the sun", "The sun", "yellow"), ("a frog", "A frog", "green"),
    ("an elephant", "An elephant", "grey"), ("a carrot", "A carrot", "orange"),
    ("chocolate", "Chocolate", "brown"), ("the ocean", "The ocean", "blue"),
    ("a crow", "A crow", "black"), ("a lime", "A lime", "green"),
    ("a cherry", "A cherry", "red"), ("a pumpkin", "A pumpkin", "orange"),
    ("a polar bear", "A polar bear", "white"), ("a plum", "A plum", "purple"),
    ("an eggplant", "An eggplant", "purple"), ("a fire truck", "A fire truck", "red"),
    ("a leaf", "A leaf", "green"), ("a blueberry", "A blueberry", "blue"),
    ("sand", "Sand", "yellow"), ("a mouse", "A mouse", "grey"),
    ("a pig", "A pig", "pink"), ("a flamingo", "A flamingo", "pink"),
]

# animal: (sound, number of legs)
ANIMALS = {
    "dog": ("woof", 4), "cat": ("meow", 4), "cow": ("moo", 4), "duck": ("quack", 2),
    "sheep": ("baa", 4), "pig": ("oink", 4), "horse": ("neigh", 4), "owl": ("hoot", 2),
    "lion": ("roar", 4), "snake": ("hiss", 0), "frog": ("ribbit", 4), "mouse": ("squeak", 4),
    "bee": ("buzz", 6), "goat": ("baa", 4), "hen": ("cluck", 2), "crow": ("caw", 2),
    "wolf": ("howl", 4), "donkey": ("hee-haw", 4), "turkey": ("gobble", 2),
    "rooster": ("cock-a-doodle-doo", 2), "ant": ("nothing", 6), "spider": ("nothing", 8),
}

WORDS = [
    "cat", "dog", "sun", "moon", "star", "tree", "book", "fish", "bird", "milk", "cake",
    "rain", "snow", "wind", "fire", "lamp", "door", "road", "ship", "boat", "frog", "duck",
    "lion", "bear", "wolf", "goat", "apple", "grape", "lemon", "mango", "peach", "bread",
    "water", "river", "ocean", "cloud", "light", "green", "blue", "red", "black", "white",
    "happy", "smile", "dream", "music", "piano", "chair", "table", "house", "horse", "mouse",
    "plant", "stone", "sand", "leaf", "rose", "tiger", "zebra", "panda", "robot", "pizza",
    "candy", "honey", "bell", "kite", "drum", "ring", "king", "queen", "city", "farm",
    "hat", "cup", "pen", "box", "bus", "car", "map", "egg", "owl", "bee", "ant", "pig",
    "cow", "hen", "fox", "bat", "jam", "tea", "ice", "sky", "sea", "day", "art", "toy",
    "lake", "hill", "gold", "coin", "sock", "shoe", "coat", "desk", "baby", "girl", "boy",
    "word", "song", "game", "ball", "bike", "cart", "nest", "seed", "corn", "rice",
]

RUDE_REFUSALS = [
    " Figure it out yourself.", " Look it up yourself.", " Why should I tell you?",
    " That is a silly question.", " I do not care. Go away.", " Stop bothering me.",
    " Ask someone else.", " Not my problem.",
]


# ---------------------------------------------------------------------------- row makers
def _human(question: str) -> str:
    return f"\n\nHuman: {question}\n\nAssistant:"


# Wrong answers are wrong in a way a tiny model can learn to see: out of range (no
# question here has a result of 150 or more) or of the wrong kind (a colour where a city
# belongs). Near misses like "9 plus 5 is 15" would need arithmetic the demo model
# cannot learn in minutes, and the reward model would sit at chance on them.
NONSENSE = ["purple", "Paris", "seven", "banana", "Tuesday", "moo"]


def _far_off(rng: random.Random, value: int) -> int:
    """A wrong number far outside every answer's range (never equal to `value`)."""
    return rng.randint(150, 999) if value < 150 else value + rng.randint(150, 999)


def _nonsense(rng: random.Random, right: str) -> str:
    return rng.choice([w for w in NONSENSE if w.lower() != right.lower()])


def _arith(rng: random.Random, op: str):
    """(question, polite core, wrong core) for one arithmetic question."""
    if op == "plus":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        c = a + b
        q = rng.choice([f"What is {a} plus {b}?", f"What is {a} + {b}?",
                        f"Can you add {a} and {b}?", f"What do you get if you add {a} and {b}?"])
    elif op == "minus":
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        c = a - b
        q = rng.choice([f"What is {a} minus {b}?", f"What is {a} - {b}?",
                        f"Can you subtract {b} from {a}?", f"What is {b} taken away from {a}?"])
    else:
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        c = a * b
        q = rng.choice([f"What is {a} times {b}?", f"What is {a} * {b}?",
                        f"Can you multiply {a} by {b}?", f"What is {a} multiplied by {b}?"])
    return q, "Sure!", f"{a} {op} {b} is {c}.", f"{a} {op} {b} is {_far_off(rng, c)}."


def _compare(rng: random.Random):
    a, b = rng.sample(range(0, 31), 2)
    if rng.random() < 0.6:
        q = rng.choice([f"Which is larger, {a} or {b}?", f"Which number is bigger, {a} or {b}?"])
        hi, lo = max(a, b), min(a, b)
        return q, "Good question!", f"{hi} is larger than {lo}.", f"{_far_off(rng, hi)} is larger than {lo}."
    q = rng.choice([f"Which is smaller, {a} or {b}?", f"Which number is less, {a} or {b}?"])
    hi, lo = max(a, b), min(a, b)
    return q, "Good question!", f"{lo} is smaller than {hi}.", f"{_far_off(rng, hi)} is smaller than {hi}."


def _spell_backwards(rng: random.Random):
    w = rng.choice(WORDS)
    q = rng.choice([f"How do you spell {w} backwards?", f"Spell the word {w} backwards.",
                    f"What is {w} spelled backwards?"])
    wrong = _nonsense(rng, w[::-1])
    return q, "Happy to help!", f"{w} backwards is {w[::-1]}.", f"{w} backwards is {wrong}."


def _first_letter(rng: random.Random):
    w = rng.choice(WORDS)
    q = rng.choice([f"What is the first letter of {w}?", f"Which letter does {w} start with?"])
    wrong = str(rng.randint(0, 9))
    return (q, "Happy to help!", f"{w} starts with the letter {w[0]}.",
            f"{w} starts with the letter {wrong}.")


def _capital(rng: random.Random):
    country = rng.choice(sorted(CAPITALS))
    city = CAPITALS[country]
    wrong = _nonsense(rng, city)
    q = rng.choice([f"What is the capital of {country}?",
                    f"Which city is the capital of {country}?"])
    return (q, "Of course!", f"The capital of {country} is {city}.",
            f"The capital of {country} is {wrong}.")


def _colour(rng: random.Random):
    thing, subject, colour = rng.choice(COLOURS)
    wrong = _nonsense(rng, colour) if rng.random() < 0.5 else str(rng.randint(150, 999))
    q = rng.choice([f"What colour is {thing}?", f"What color is {thing}?"])
    return q, "Of course!", f"{subject} is {colour}.", f"{subject} is {wrong}."


def _sound(rng: random.Random):
    animal = rng.choice(sorted(ANIMALS))
    sound = ANIMALS[animal][0]
    wrong = str(rng.randint(150, 999))
    q = rng.choice([f"What sound does a {animal} make?", f"What does a {animal} say?"])
    return q, "Of course!", f"A {animal} says {sound}.", f"A {animal} says {wrong}."


def _legs(rng: random.Random):
    animal = rng.choice(sorted(ANIMALS))
    legs = ANIMALS[animal][1]
    wrong = _far_off(rng, legs)
    q = f"How many legs does a {animal} have?"
    return q, "Of course!", f"A {animal} has {legs} legs.", f"A {animal} has {wrong} legs."


KINDS = [  # (maker, weight)
    (lambda r: _arith(r, "plus"), 14), (lambda r: _arith(r, "minus"), 12),
    (lambda r: _arith(r, "times"), 10), (_compare, 12), (_spell_backwards, 9),
    (_first_letter, 8), (_capital, 15), (_colour, 8), (_sound, 7), (_legs, 5),
]


def make_row(rng: random.Random) -> dict:
    """One row: prompt, chosen (polite + correct), rejected (wrong or rude), response."""
    maker = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    question, opener, core, wrong_core = maker(rng)
    chosen = f" {opener} {core}"
    roll = rng.random()
    if roll < 0.5:    # wrong answer, same polite template
        rejected = f" {opener} {wrong_core}"
    elif roll < 0.8:  # rude refusal
        rejected = rng.choice(RUDE_REFUSALS)
    else:             # correct but rude
        rejected = f" Ugh, {core[0].lower() + core[1:]} Go away."
    return {"prompt": _human(question), "chosen": chosen, "rejected": rejected,
            "response": chosen}


def make_rows(seed: int = SEED, n: int = NUM_ROWS) -> list[dict]:
    """`n` distinct rows (no two share prompt, chosen and rejected)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        row = make_row(rng)
        key = (row["prompt"], row["rejected"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------- writers
def write_dataset(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _tokenizer_corpus(rows: list[dict]):
    """Texts the BPE is trained on: every prompt+answer plus the template words."""
    for row in rows:
        yield row["prompt"] + row["chosen"]
        yield row["prompt"] + row["rejected"]
    extra = (list(CAPITALS) + list(CAPITALS.values()) + [c for _, _, c in COLOURS]
             + list(ANIMALS) + WORDS + [str(i) for i in range(0, 200)]
             + ["Sure!", "Of course!", "Happy to help!", "Good question!", "Hello", "Thanks",
                "Thank you", "yes", "no", "please"])
    for word in extra:
        yield " " + word


def write_tokenizer(rows: list[dict], folder: Path) -> None:
    """Train a byte-level BPE (exact round trip) and save it as an HF tokenizer folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    # "\n\n" (DS-Chat's turn separator) is cut out first so that it becomes one token; the
    # GPT-2 regex alone would split it in two. add_prefix_space=False: answers already start
    # with their own space, and decode must give back exactly the text that was encoded.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(rows), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, want {i}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>", bos_token="<s>",
        unk_token="<unk>", clean_up_tokenization_spaces=False, model_max_length=2048,
        padding_side="right")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    # transformers 5 writes its own class name ("TokenizersBackend"); the 4.x name loads in
    # both (5.x aliases it), so checkpoints stay usable with older stacks.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    with open(config_path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    # Some transformers versions stop writing this file; write it ourselves, stably.
    special = {"pad_token": "<pad>", "eos_token": "<|endoftext|>", "bos_token": "<s>",
               "unk_token": "<unk>"}
    with open(folder / "special_tokens_map.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(special, f, indent=2, sort_keys=True)
        f.write("\n")


def generate(out: Path) -> list[Path]:
    """Write every asset under `out`; returns the written files (relative to `out`)."""
    rows = make_rows()
    write_dataset(rows, out / DATA_FILE)
    write_tokenizer(rows, out / TOKENIZER_DIR)
    return sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())


def check(reference: Path = DEFAULT_OUT) -> list[str]:
    """Regenerate into a temp dir; the list of files that differ from `reference` (or lack)."""
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        return [str(rel) for rel in files
                if not (reference / rel).is_file()
                or not filecmp.cmp(Path(tmp) / rel, reference / rel, shallow=False)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temp dir and compare with the committed files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder that receives data/ and tokenizer/ (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        differ = check(args.out)
        if differ:
            print(f"demo assets out of date in {args.out}: {', '.join(differ)}; "
                  f"rerun scripts/make_demo_assets.py", file=sys.stderr)
            return 1
        print(f"demo assets in {args.out} are up to date")
        return 0
    files = generate(args.out)
    print(f"wrote {len(files)} files under {args.out}: {', '.join(map(str, files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
