"""dpmini.comm: collective copies between devices, mirroring ``torch.cuda.comm``.

Every function is implemented in C (``dpmini._dpmini``); see each docstring for
shapes, dtypes, units and errors. Rules follow PyTorch's ``torch.cuda.comm``
(spec §8) with the differences listed in the README.
"""
from ._dpmini import (
    comm_broadcast as broadcast,
    comm_broadcast_coalesced as broadcast_coalesced,
    comm_gather as gather,
    comm_reduce_add as reduce_add,
    comm_reduce_add_coalesced as reduce_add_coalesced,
    comm_scatter as scatter,
)

__all__ = [
    "scatter",
    "gather",
    "broadcast",
    "broadcast_coalesced",
    "reduce_add",
    "reduce_add_coalesced",
]
