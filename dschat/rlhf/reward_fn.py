"""User reward functions for step 3: ``--reward_fn FILE.py:FUNCTION`` and ``--reward_weights``.

A reward function scores a batch of generated answers in Python instead of with a reward
model (verifiable tasks: maths, code, format checks)::

    def my_reward(prompts: list[str], answers: list[str], **fields) -> list[float]:
        ...

* ``prompts``: DS-Chat prompts ("\\n\\nHuman: ...\\n\\nAssistant:"), one per answer;
* ``answers``: the generated answer texts (without the prompt);
* ``fields``: every other column of the dataset row, each as a keyword holding one value
  per answer (e.g. ``answer=["14", "3"]``); accept ``**kwargs`` to ignore the rest;
* returns one finite number per answer (list, tuple, 1-D tensor or numpy array).

`load_reward_fn` resolves the spec (a file path or an importable module, then ``:`` and
the function name); `score` calls the function and checks what it returns; `combine_rewards`
sums several functions' rewards with ``--reward_weights``. Every mistake is a
`RewardFunctionError` (a UserInputError: one line, exit code 2) naming the function and,
where there is one, the row and the start of its prompt.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from dschat.utils.errors import UserInputError

__all__ = ["RewardFunctionError", "load_reward_fn", "describe", "score", "combine_rewards"]

RewardFn = Callable[..., Sequence[float]]
_RESERVED = ("prompts", "answers")  # the positional arguments cannot also come as fields


class RewardFunctionError(UserInputError):
    """A user reward function that cannot be loaded, raised, or returned something other
    than one finite number per answer. The message names the function (and row)."""


# ---------------------------------------------------------------------------- loading

def load_reward_fn(spec: str, flag: str = "--reward_fn") -> RewardFn:
    """``"path/file.py:function"`` or ``"package.module:function"`` -> the function.

    A target ending in ``.py``, holding a path separator or naming an existing file is
    loaded as a file (its own module, not put on sys.path); otherwise it is imported.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise RewardFunctionError(f"{flag} {spec!r}: expected FILE.py:FUNCTION or "
                                  "package.module:FUNCTION (e.g. rewards.py:exact_match)")
    module = _load_file(target, spec, flag) if _is_file_target(target) else _import(target, spec, flag)
    fn = getattr(module, name, None)
    if fn is None:
        known = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardFunctionError(f"{flag} {spec}: {target} has no function {name!r} "
                                  f"(it defines: {', '.join(known) or 'nothing callable'})")
    if not callable(fn):
        raise RewardFunctionError(f"{flag} {spec}: {name} in {target} is not a function "
                                  f"(type {type(fn).__name__})")
    return fn


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target or Path(target).is_file()


def _load_file(target: str, spec: str, flag: str):
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise RewardFunctionError(f"{flag} {spec}: no such file {target}")
    # a name of its own per file, so two reward files may both be called rewards.py
    module_name = "dschat_reward_fn_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardFunctionError(f"{flag} {spec}: loading {target} failed "
                                  f"({type(e).__name__}: {_short(e)})") from None
    return module


def _import(target: str, spec: str, flag: str):
    try:
        return importlib.import_module(target)
    except Exception as e:  # ModuleNotFoundError, or the module's own import-time error
        raise RewardFunctionError(f"{flag} {spec}: cannot import {target} "
                                  f"({type(e).__name__}: {_short(e)})") from None


def describe(fn: RewardFn) -> str:
    """How messages name a reward function: ``name (file)``."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    try:
        where = inspect.getsourcefile(fn)
    except TypeError:
        where = None
    return f"{name} ({where})" if where else name


def _short(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    return text[0][:limit] if text else ""


# ---------------------------------------------------------------------------- scoring

def score(fn: RewardFn, prompts: Sequence[str], answers: Sequence[str],
          fields: Optional[Sequence[dict]] = None, *, skip_bad: bool = False,
          name: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """Call ``fn(prompts, answers, **fields_as_lists)``: -> ``(rewards [B] fp32, valid [B] bool)``.

    ``fields``: one dict per answer with the row's other dataset columns; they are passed
    as keywords of per-row lists (a column missing from a row gives None there). The
    function must return one finite number per answer. An exception is raised again as a
    `RewardFunctionError` naming the row that fails when called alone. A non-finite value
    (or None) is an error too, unless ``skip_bad``: then that row is masked out
    (``valid`` False, reward 0) and the caller counts ``(~valid).sum()``.
    """
    who = name or describe(fn)
    n = len(answers)
    if len(prompts) != n or (fields is not None and len(fields) != n):
        raise ValueError(f"score: {len(prompts)} prompts, {n} answers and "
                         f"{len(fields) if fields is not None else n} field rows must match")
    columns = _columns(fields or [{}] * n, who)
    try:
        out = fn(list(prompts), list(answers), **columns)
    except Exception as e:
        raise _located_error(fn, who, prompts, answers, columns, e) from e
    values = _as_list(out, n, who)
    rewards, valid = torch.zeros(n, dtype=torch.float32), torch.ones(n, dtype=torch.bool)
    for i, v in enumerate(values):
        x = _number(v, i, who, prompts[i])
        if x is None or not math.isfinite(x):
            if not skip_bad:
                raise RewardFunctionError(f"reward function {who} returned {v!r} for row {i} "
                                          f"(prompt: {_head(prompts[i])}); it must return a finite "
                                          "number for every answer")
            valid[i] = False
        else:
            rewards[i] = x
    return rewards, valid


def _columns(fields: Sequence[dict], who: str) -> dict[str, list]:
    """Rows of fields -> {column: [one value per row]} over the union of the rows' columns."""
    keys = list(dict.fromkeys(k for row in fields for k in row))
    clash = [k for k in keys if k in _RESERVED]
    if clash:
        raise RewardFunctionError(f"reward function {who}: dataset column {clash[0]!r} clashes with "
                                  "the positional argument of that name; rename the column")
    return {k: [row.get(k) for row in fields] for k in keys}


def _located_error(fn, who, prompts, answers, columns, error) -> RewardFunctionError:
    """The error for a raising batch call, naming the first row that raises when alone."""
    for i in range(len(answers)):
        try:
            fn([prompts[i]], [answers[i]], **{k: [v[i]] for k, v in columns.items()})
        except Exception as e:
            return RewardFunctionError(f"reward function {who} raised {type(e).__name__}: {_short(e)} "
                                       f"on row {i} (prompt: {_head(prompts[i])})")
    return RewardFunctionError(f"reward function {who} raised {type(error).__name__}: {_short(error)} "
                               f"on a batch of {len(answers)} rows (no row raises alone)")


def _as_list(out, n: int, who: str) -> list:
    if isinstance(out, Tensor) or hasattr(out, "tolist"):  # tensors, numpy arrays
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, (list, tuple)):
        raise RewardFunctionError(f"reward function {who} returned a {type(out).__name__}; "
                                  f"expected a list of {n} numbers")
    if len(out) != n:
        raise RewardFunctionError(f"reward function {who} returned {len(out)} values for {n} answers")
    return list(out)


def _number(v, i: int, who: str, prompt: str) -> Optional[float]:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise RewardFunctionError(f"reward function {who} returned {v!r} (a {type(v).__name__}) for "
                                  f"row {i} (prompt: {_head(prompt)}); expected a number") from None


def _head(prompt: str) -> str:
    return repr(prompt[:80] + ("..." if len(prompt) > 80 else ""))


# ---------------------------------------------------------------------------- combining

def combine_rewards(rewards: Sequence[Tensor], weights: Optional[Sequence[float]] = None,
                    flag: str = "--reward_weights") -> Tensor:
    """Weighted sum of several reward functions' rewards: each ``[B]`` -> ``[B]`` fp32.

    ``weights`` default to 1 each (one per function, in ``--reward_fn`` order). Rows a
    function masked (`score`'s ``valid``) should be masked in the sum too: AND the masks.
    """
    if not rewards:
        raise ValueError("combine_rewards: no rewards given")
    if weights is None:
        weights = [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise UserInputError(f"{flag}: {len(weights)} weights for {len(rewards)} reward functions; "
                             "give one weight per --reward_fn")
    shapes = {tuple(r.shape) for r in rewards}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"combine_rewards: rewards must all be [B], got shapes {sorted(shapes)}")
    return sum(float(w) * r.float() for w, r in zip(weights, rewards))
