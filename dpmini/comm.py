"""dpmini.comm: collective copies between devices, mirroring ``torch.cuda.comm``.

Every function is implemented in C (the ``dpmini._dpmini.comm`` submodule, whose
functions report ``__module__ == "dpmini.comm"``); see each docstring for shapes,
dtypes, units and errors. Rules follow PyTorch's ``torch.cuda.comm`` (docs/spec.md 8) with
the differences listed in docs/differences.md.
"""
from ._dpmini import comm as _comm

scatter = _comm.scatter
gather = _comm.gather
broadcast = _comm.broadcast
broadcast_coalesced = _comm.broadcast_coalesced
reduce_add = _comm.reduce_add
reduce_add_coalesced = _comm.reduce_add_coalesced

__all__ = [
    "scatter",
    "gather",
    "broadcast",
    "broadcast_coalesced",
    "reduce_add",
    "reduce_add_coalesced",
]
