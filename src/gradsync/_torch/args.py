"""The torch backend's checks of a collective's arguments, made at the call (on the
caller's thread, before any step), as gloo makes its own: a refused call leaves the group
usable."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_inputs(tensors: Sequence[torch.Tensor], call: str) -> None:
    """Refuse anything but one CPU tensor: a list of several is, to gloo, one tensor per
    device (allreduce reduces them all together, broadcast copies the root's one into
    each), which gradsync does not do."""
    if len(tensors) != 1:
        raise ValueError(
            f"gradsync: {call} of {len(tensors)} tensors in one call is not supported "
            f"(gloo takes such a list as one tensor per device): call it once per tensor"
        )
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"gradsync: only CPU tensors are supported, got one on {t.device}")


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
