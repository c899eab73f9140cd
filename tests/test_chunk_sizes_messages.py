"""The chunk_sizes sum in the error message is exact and cannot overflow int64."""

import numpy as np
import pytest

import dpmini

D2 = ["cpu:0", "cpu:1"]
D4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


# --- the chunk_sizes sum in the error message cannot overflow --------------

@pytest.mark.parametrize("sizes", [[2**62] * 4, [2**63 - 1] * 2 + [0, 0]])
def test_chunk_sizes_sum_overflow_message(sizes):
    with pytest.raises(ValueError) as info:
        dpmini.scatter(np.zeros((5, 2)), D4, chunk_sizes=sizes)
    msg = str(info.value)
    assert f"sum to more than {2**63 - 1}, but the array has size 5" in msg, msg
    assert "sum to -" not in msg and "sum to 0," not in msg


def test_chunk_sizes_sum_in_range_message():
    with pytest.raises(ValueError, match=r"chunk_sizes \[1, 1\] sum to 2, but the array "
                                         r"has size 5"):
        dpmini.scatter(np.zeros((5, 2)), D2, chunk_sizes=[1, 1])
    with pytest.raises(ValueError, match="sum to more than 9223372036854775807"):
        dpmini.scatter(np.zeros(5), D2, chunk_sizes=[2**63 - 1, 2**63 - 1])
