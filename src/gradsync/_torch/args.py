"""The torch backend's checks of a collective's arguments, made at the call (on the
caller's thread, before any step), as gloo makes its own: a refused call leaves the group
usable."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_inputs(tensors: Sequence[torch.Tensor], call: str, *, written: bool = False) -> None:
    """Refuse anything but one CPU tensor: a list of several is, to gloo, one tensor per
    device (allreduce reduces them all together, broadcast copies the root's one into
    each), which gradsync does not do. ``written``: the result goes into it, so its
    elements must not share memory (an ``expand``ed tensor)."""
    if len(tensors) != 1:
        raise ValueError(
            f"gradsync: {call} of {len(tensors)} tensors in one call is not supported "
            f"(gloo takes such a list as one tensor per device): call it once per tensor"
        )
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"gradsync: only CPU tensors are supported, got one on {t.device}")
        if written and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True)):
            raise ValueError(
                f"gradsync: {call} writes its result into the tensor, whose elements share "
                f"memory (stride {tuple(t.stride())}, an expand()ed tensor): pass a "
                f"contiguous one"
            )


def check_gather_outputs(
    outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], world: int
) -> None:
    """Refuse, at the call as gloo does, outputs that cannot take every rank's inputs."""
    if len(outputs) != len(inputs):
        raise ValueError(
            f"gradsync: allgather: {len(outputs)} output lists for {len(inputs)} input tensors"
        )
    for i, (outs, t) in enumerate(zip(outputs, inputs, strict=True)):
        if len(outs) != world:
            raise ValueError(
                f"gradsync: allgather: output list {i} holds {len(outs)} tensors, "
                f"expected the world size {world}"
            )
        for r, o in enumerate(outs):
            if o.shape != t.shape or o.dtype != t.dtype or o.device.type != "cpu":
                raise ValueError(
                    f"gradsync: allgather: output {i}[{r}] is {o.dtype}{list(o.shape)} on "
                    f"{o.device}, expected {t.dtype}{list(t.shape)} on cpu like its input"
                )
            if o.requires_grad and o.is_leaf and torch.is_grad_enabled():
                # An in-place write autograd forbids; gloo refuses it too (not under no_grad).
                raise ValueError(
                    f"gradsync: allgather: output {i}[{r}] is a leaf tensor that requires grad"
                )
