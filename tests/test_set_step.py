"""Tier 1 (pure logic): ``moe_comm.set_step`` accepts exactly the steps an int64 header word carries."""
import pytest
import torch

import moe_comm
from moe_comm.comm.wire import Phase, Word, current_step, header


@pytest.mark.parametrize("bad", [2**63, 2**64, 10**30, -1, -(2**63), True, False, 1.0, 2.0**63, "3",
                                 torch.tensor(3), None.__class__])
def test_set_step_rejects_what_an_int64_word_cannot_carry(bad):
    try:
        moe_comm.set_step(5)
        with pytest.raises(ValueError, match=r"set_step: step must be an int >= 0 or None, "
                                             r"in \[0, 2\*\*63 - 1 = 9223372036854775807\].*got "):
            moe_comm.set_step(bad)
        assert current_step() == 5  # a rejected call leaves the step as it was
    finally:
        moe_comm.set_step(None)


def test_set_step_takes_the_whole_int64_range_and_the_header_carries_it():
    try:
        for step in (0, 1, 2**62, 2**63 - 1):
            moe_comm.set_step(step)
            words = header(Phase.FORWARD, dispatcher=0, call=1, chunks=1, experts=4, world=2)
            assert torch.tensor(words, dtype=torch.int64)[Word.STEP].item() == step
    finally:
        moe_comm.set_step(None)
    assert current_step() == -1
