"""Faults of the parallel wrappers: ranks that build a split model from different weights.

Sequence and expert parallelism split a full model that every rank builds for itself. Built from
differently seeded weights, they ran without a word and their outputs were off by 0.6-0.8; now the
construction compares the ranks' weights (``llmedu.parallel.replicas``) and every rank raises, naming
the first tensor that differs. The multi-process cases run inside the launches of the wrappers' own
tests (starting processes costs seconds): ``test_parallel_sequence_parallel.py``
(``test_weights_that_differ_across_ranks_are_refused_naming_the_tensor``) and
``test_parallel_experts.py`` (``test_bad_input_fails_clearly``). Here: the checksum they compare.
"""

import torch

from llmedu.parallel.replicas import checksum


def test_the_checksum_sees_every_byte_and_its_place():
    x = torch.randn(64)
    assert checksum(x) == checksum(x.clone())
    y = x.clone()
    y[7] = torch.nextafter(y[7], torch.tensor(float("inf")))  # one ulp
    assert checksum(y) != checksum(x)
    assert checksum(x.flip(0)) != checksum(x)  # the same values in another order
    assert checksum(x.to(torch.bfloat16)) == checksum(x.to(torch.bfloat16).clone())
    assert checksum(x.view(8, 8).t()) == checksum(x.view(8, 8).t().contiguous())  # its values, not its strides
