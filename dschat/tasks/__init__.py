"""Verifiable tasks for critic-free RL (step 3 with a `--reward_fn` instead of a reward model).

Each task module generates DS-Chat prompt datasets (JSONL rows with prompt / chosen /
rejected plus the reference `answer`), offers a reward function usable as
``--reward_fn dschat.tasks.<task>:<function>``, and an `eval` command that measures a
model's accuracy on held-out problems.

    arithmetic   multi-step integer word problems, GSM8K answer format ("#### N")
"""
