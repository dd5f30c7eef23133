"""The collectives the "gradsync" torch backend does not run: each refused at the call,
naming itself. Left to torch, every one failed with "No backend type associated with
device type cpu", which names nothing the caller did."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


def _refuse(call: str) -> Callable[..., NoReturn]:
    """A process group method that raises, at the call, that ``call`` is unsupported."""

    def refused(self: object, *args: object, **kwargs: object) -> NoReturn:
        # NotImplementedError is a RuntimeError, which is what torch's own refusals raise.
        raise NotImplementedError(
            f'gradsync: {call} is not supported by the "gradsync" backend (it runs allreduce, '
            f"broadcast, allgather and barrier); run it over a gloo group: "
            f'dist.new_group(backend="gloo")'
        )

    return refused


class RefusedCollectives:
    """A mixin of the ProcessGroup methods that torch.distributed's functions call (by
    their names in torch 2.13 and the names torch still falls back to), each refusing."""

    reduce = _refuse("reduce")
    gather = _refuse("gather (gather, gather_object)")
    scatter = _refuse("scatter (scatter, scatter_object_list)")
    reduce_scatter = _refuse("reduce_scatter")
    reduce_scatter_single = _refuse("reduce_scatter_tensor")
    _reduce_scatter_base = _refuse("reduce_scatter_tensor")
    reduce_scatter_single_coalesced = _refuse("reduce_scatter_tensor (coalesced)")
    reduce_scatter_tensor_coalesced = _refuse("reduce_scatter_tensor (coalesced)")
    alltoall = _refuse("all_to_all")
    all_to_all_single = _refuse("all_to_all_single")
    alltoall_base = _refuse("all_to_all_single")
    all_gather_single = _refuse("all_gather_into_tensor")
    _allgather_base = _refuse("all_gather_into_tensor")
    all_gather_single_coalesced = _refuse("all_gather_into_tensor (coalesced)")
    allgather_into_tensor_coalesced = _refuse("all_gather_into_tensor (coalesced)")
    allgather_coalesced = _refuse("all_gather_coalesced")
    allreduce_coalesced = _refuse("all_reduce_coalesced")
    send = _refuse("send (send, isend, batch_isend_irecv)")
    recv = _refuse("recv (recv, irecv, batch_isend_irecv)")
    recv_anysource = _refuse("recv from any source")
