"""Answer masks of step 3: where an answer ends, with and without a separate pad token."""
import torch

from dschat.rlhf.trainer import answer_mask


def test_answer_ends_at_first_eos_and_keeps_it():
    eos, pad = 1, 0
    answers = torch.tensor([[5, 6, 1, 0, 0],     # eos then pads
                            [5, 1, 7, 1, 0],     # tokens after the first eos do not count
                            [5, 6, 7, 8, 9],     # no eos: the whole width
                            [1, 0, 0, 0, 0]])    # eos only
    assert answer_mask(answers, eos, pad).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0],
                                                      [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_pad_equal_to_eos_keeps_the_eos_token():
    eos = pad = 2  # llama / gpt2 convention
    answers = torch.tensor([[5, 6, 2, 2, 2], [7, 2, 2, 2, 2]])
    assert answer_mask(answers, eos, pad).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
