"""User reward functions (dschat.rlhf.reward_fn): loading `--reward_fn` specs, scoring with
checks on what the function returns, and `--reward_weights`, on a user file in tmp_path."""
import textwrap

import pytest
import torch

from dschat.rlhf.reward_fn import RewardFunctionError, combine_rewards, load_reward_fn, score
from dschat.utils.errors import UserInputError

USER_FILE = textwrap.dedent('''
    import math

    NOT_A_FUNCTION = 3

    def length(prompts, answers, **fields):
        return [float(len(a)) for a in answers]

    def matches(prompts, answers, answer, level, **fields):
        # one value per row in each field list
        return [(1.0 if a.strip() == ref else 0.0) + lvl for a, ref, lvl in zip(answers, answer, level)]

    def raises(prompts, answers, **fields):
        return [1.0 / (len(a) - 4) for a in answers]   # " boom!" has 6 characters, "four" 4

    def nan_on_bad(prompts, answers, **fields):
        return [float("nan") if "bad" in a else 1.0 for a in answers]

    def none_on_bad(prompts, answers, **fields):
        return [None if "bad" in a else 2 for a in answers]

    def wrong_count(prompts, answers, **fields):
        return [1.0]

    def words(prompts, answers, **fields):
        return ["high" for a in answers]

    def as_tensor(prompts, answers, **fields):
        import torch
        return torch.arange(len(answers))
''')
PROMPTS = ["\n\nHuman: " + "x" * 100 + "\n\nAssistant:", "\n\nHuman: Two?\n\nAssistant:"]


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return str(path)


def test_load_from_a_file_and_from_a_module(user_file):
    fn = load_reward_fn(f"{user_file}:length")
    rewards, valid = score(fn, PROMPTS, [" abc", " de"], None)
    assert rewards.tolist() == [4.0, 3.0] and valid.tolist() == [True, True]
    assert load_reward_fn("dschat.rlhf.reward_fn:combine_rewards") is combine_rewards


@pytest.mark.parametrize("spec, message", [
    ("nocolon.py", "expected FILE.py:FUNCTION"),
    ("file.py:", "expected FILE.py:FUNCTION"),
    ("/no/such/file.py:fn", "no such file /no/such/file.py"),
    ("no_such_module_xyz:fn", "cannot import no_such_module_xyz"),
])
def test_bad_specs_name_the_flag(spec, message):
    with pytest.raises(UserInputError, match=message) as err:
        load_reward_fn(spec)
    assert str(err.value).startswith(f"--reward_fn {spec}") or f"--reward_fn {spec!r}" in str(err.value)


def test_missing_or_uncallable_function_and_broken_file(user_file, tmp_path):
    with pytest.raises(RewardFunctionError, match=r"has no function 'nope' \(it defines: .*length"):
        load_reward_fn(f"{user_file}:nope")
    with pytest.raises(RewardFunctionError, match=r"NOT_A_FUNCTION in .* is not a function \(type int\)"):
        load_reward_fn(f"{user_file}:NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(RewardFunctionError, match=f"--reward_fn {broken}:f: loading .* failed .SyntaxError"):
        load_reward_fn(f"{broken}:f")


def test_fields_come_as_per_row_lists(user_file):
    fn = load_reward_fn(f"{user_file}:matches")
    fields = [{"answer": "14", "level": 0.5, "source": "a"}, {"answer": "3", "level": 0.0}]
    rewards, valid = score(fn, PROMPTS, [" 14", " 4"], fields)
    assert rewards.tolist() == [1.5, 0.0] and valid.all()
    with pytest.raises(RewardFunctionError, match="column 'answers' clashes"):
        score(fn, PROMPTS, [" 14", " 4"], [{"answers": 1}, {}])


def test_an_exception_names_the_function_row_and_prompt(user_file):
    fn = load_reward_fn(f"{user_file}:raises")
    with pytest.raises(RewardFunctionError) as err:
        score(fn, PROMPTS[::-1], [" boom!", "four"], None, skip_bad=True)  # exceptions raise anyway
    message = str(err.value)
    assert "raises (" in message and "my_rewards.py" in message and "ZeroDivisionError" in message
    assert "row 1" in message and repr(PROMPTS[0][:80] + "...") in message
    assert isinstance(err.value, UserInputError)


def test_non_finite_values_raise_or_are_masked(user_file):
    for name in ("nan_on_bad", "none_on_bad"):
        fn = load_reward_fn(f"{user_file}:{name}")
        with pytest.raises(RewardFunctionError, match=f"{name} .* returned (nan|None) for row 0 "
                                                      r"\(prompt: '\\n\\nHuman: xxx"):
            score(fn, PROMPTS, [" bad", " good"], None)
        rewards, valid = score(fn, PROMPTS, [" bad", " good"], None, skip_bad=True)
        assert valid.tolist() == [False, True] and rewards[0] == 0 and rewards[1] > 0
        assert int((~valid).sum()) == 1


def test_wrong_count_and_type(user_file):
    with pytest.raises(RewardFunctionError, match="wrong_count .* returned 1 values for 2 answers"):
        score(load_reward_fn(f"{user_file}:wrong_count"), PROMPTS, ["a", "b"], None)
    with pytest.raises(RewardFunctionError, match="returned 'high' \\(a str\\) for row 0"):
        score(load_reward_fn(f"{user_file}:words"), PROMPTS, ["a", "b"], None, skip_bad=True)
    rewards, _ = score(load_reward_fn(f"{user_file}:as_tensor"), PROMPTS, ["a", "b"], None)
    assert rewards.tolist() == [0.0, 1.0] and rewards.dtype == torch.float32


def test_combine_rewards_with_weights():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 2.0])
    assert combine_rewards([a, b]).tolist() == [1.5, 2.0]
    assert combine_rewards([a, b], [2.0, -1.0]).tolist() == [1.5, -2.0]
    with pytest.raises(UserInputError, match="--reward_weights: 1 weights for 2 reward functions"):
        combine_rewards([a, b], [1.0])
