"""Helpers of the tests that check maths against numbers worked out by hand."""
import math

import torch

LN = math.log
# per-token [B=2, T=3] mask: the second row's last token masked
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)
