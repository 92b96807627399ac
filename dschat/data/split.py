"""DS-Chat's `--data_split` semantics: seeded, disjoint, contiguous chunks per training step.

`--data_split 2,4,4` is normalised to fractions (0.2, 0.4, 0.4). A permutation of each
dataset's train split (seeded by `--seed`) is cut into contiguous chunks with those sizes;
step k (1, 2, 3) takes chunk k-1. The eval split is chunked the same way (as upstream
does), so the three steps see disjoint data when they share seed and split. A dataset that
only has a train split is first cut 9:1 into train / eval with the same seed.
"""
from __future__ import annotations

import numpy as np

from dschat.utils.errors import UserInputError

TRAIN_EVAL_SPLIT = (0.9, 0.1)


def parse_data_split(data_split: str) -> tuple[float, ...]:
    """'2,4,4' -> (0.2, 0.4, 0.4); three non-negative numbers with a positive sum."""
    text = str(data_split)
    try:
        numbers = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserInputError(f"--data_split {text}: expected three comma-separated numbers "
                             f"such as 2,4,4") from None
    if len(numbers) != 3 or any(not np.isfinite(x) or x < 0 for x in numbers) \
            or sum(numbers) <= 0:
        raise UserInputError(f"--data_split {text}: expected three non-negative numbers with "
                             f"a positive sum, one per training step, such as 2,4,4")
    total = sum(numbers)
    return tuple(x / total for x in numbers)


def chunk_bounds(size: int, fractions) -> list[int]:
    """Boundaries [0, b1, ..., size] of contiguous chunks with the given fractions."""
    cumulative = np.cumsum(np.asarray(fractions, dtype=np.float64))
    bounds = [0] + [int(round(c * size)) for c in cumulative]
    bounds[-1] = size
    return bounds


def permutation(size: int, seed: int) -> np.ndarray:
    """The seeded permutation every split is cut from (same seed -> same order)."""
    return np.random.RandomState(seed % (2 ** 32)).permutation(size)


def chunk_indices(size: int, fractions, chunk: int, seed: int) -> np.ndarray:
    """Indices (into a split of `size` rows) of chunk `chunk` of the seeded permutation."""
    bounds = chunk_bounds(size, fractions)
    return permutation(size, seed)[bounds[chunk]:bounds[chunk + 1]]


def train_eval_indices(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded 9:1 train / eval cut of a dataset that ships only a train split."""
    bounds = chunk_bounds(size, TRAIN_EVAL_SPLIT)
    order = permutation(size, seed)
    return order[:bounds[1]], order[bounds[1]:]


def take(rows: list, indices) -> list:
    """rows[i] for each index, in index order."""
    return [rows[int(i)] for i in indices]
