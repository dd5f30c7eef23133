"""A step's gradients as the engine reads them: validated once, flattened, with their layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gradsync._errors import InvalidGradsError

from .header import Layout
from .overlap import overlap_message, overlapping
from .reduce import ACCUMULATOR, check_dtype

__all__ = ["HostView", "host_view", "layout_like", "nonfinite_params", "validate_grads"]

# nonfinite_params checks arrays under this size together, in batches of this size or
# more (under twice it: a scratch array of at most 2 MiB, float16 widened to float64).
_FINITE_BATCH_BYTES = 256 * 1024


class HostView(NamedTuple):
    """A step's input in host memory: the arrays, each as a 1-D view, and their layout."""

    arrays: list[np.ndarray]
    flats: list[np.ndarray]
    layout: Layout


def validate_grads(grads: object) -> list[np.ndarray]:
    """Check that ``grads`` can be averaged in place; return them as a list.

    Raises:
        InvalidGradsError: naming the param index and what is wrong with it.
    """
    return host_view(grads).arrays


# The layout's name of each dtype validate_grads accepts: ``dtype.str`` builds a new
# string at every call.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {dt: dt.str for dt in ACCUMULATOR}


def host_view(grads: object) -> HostView:
    """:func:`validate_grads`, with each array flattened (a 1-D view) and the layout.

    One pass over the params, reading each attribute once: a step needs all three.

    Raises:
        InvalidGradsError: naming the param index and what is wrong with it.
    """
    if isinstance(grads, np.ndarray) or not isinstance(grads, Sequence):
        raise InvalidGradsError(
            f"grads must be a sequence (list or tuple) of numpy arrays, got {type(grads).__name__}"
        )
    if len(grads) == 0:
        raise InvalidGradsError("grads is empty: pass at least one gradient array")
    arrays: list[np.ndarray] = []
    flats: list[np.ndarray] = []
    layout: list[tuple[str, tuple[int, ...]]] = []
    views = False  # whether an array may share memory with another that is not itself
    for i, g in enumerate(grads):
        if not isinstance(g, np.ndarray):
            raise _not_an_array(i, g)
        # The common case (a native float dtype) is a dictionary lookup, and each message
        # is only built when it is raised.
        dtype = g.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            check_dtype(dtype, f"param {i}")
            raise InvalidGradsError(f"param {i} has non-native byte order {dtype.str}")
        flags = g.flags
        if not flags.c_contiguous:
            raise InvalidGradsError(
                f"param {i} (shape {g.shape}) is not C-contiguous; averaging is in place, so "
                "make the gradient itself contiguous and pass it (torch: p.grad = "
                "p.grad.contiguous(), then p.grad.numpy()); np.ascontiguousarray(g) would "
                "average a copy that the optimizer never sees"
            )
        if not flags.writeable:
            raise InvalidGradsError(f"param {i} (shape {g.shape}) is read-only")
        # A subclass (np.matrix, say) may reshape in its own way: its memory, as a plain
        # array, is what is averaged.
        a = g if type(g) is np.ndarray else g.view(np.ndarray)
        views = views or a.base is not None or not flags.owndata
        arrays.append(a)
        flats.append(a.ravel())  # a view (C-contiguous), and cheaper than reshape(-1)
        layout.append((name, a.shape))
    pair = overlapping(arrays, views=views)
    if pair is not None:
        i, j = pair
        what = "the same array" if grads[i] is grads[j] else "views of overlapping memory"
        raise InvalidGradsError(overlap_message(i, j, what))
    return HostView(arrays, flats, tuple(layout))


def _not_an_array(i: int, g: object) -> InvalidGradsError:
    # Told by its module: the numpy path never imports wgpu.
    if type(g).__module__.split(".")[0] == "wgpu":
        return InvalidGradsError(
            f"param {i} is a wgpu {type(g).__name__}, not a numpy array: GPU buffers "
            "are averaged with device=<the GPUDevice that owns them>"
        )
    return InvalidGradsError(
        f"param {i} is a {type(g).__name__}, not a numpy array (averaging is in place, "
        "so a converted copy would never reach you)"
    )


def nonfinite_params(arrays: Sequence[np.ndarray]) -> list[int]:
    """The indices of the arrays that hold a NaN or an Inf.

    Small arrays are checked a batch at a time, flattened side by side into one scratch
    array (one check per array costs more than the copy); only a batch with a NaN or an
    Inf is checked array by array, to name them. The scratch array has the widest dtype
    of the batch, which holds every value exactly: a float16 or float32 is non-finite
    just when it is as a float64.
    """
    bad: list[int] = []
    batch: list[int] = []
    batch_bytes = 0

    def check_batch() -> None:
        if not np.isfinite(np.concatenate([arrays[i] for i in batch], axis=None)).all():
            bad.extend(i for i in batch if not np.isfinite(arrays[i]).all())

    for i, a in enumerate(arrays):
        nbytes = a.nbytes
        if nbytes >= _FINITE_BATCH_BYTES:
            if not np.isfinite(a).all():
                bad.append(i)
            continue
        batch.append(i)
        batch_bytes += nbytes
        if batch_bytes >= _FINITE_BATCH_BYTES:
            check_batch()
            batch, batch_bytes = [], 0
    if batch:
        check_batch()
    return sorted(bad)


def layout_like(like: object) -> Layout:
    """The layout of arrays shaped like ``like`` (only shapes and dtypes are used), as
    a step's layout is written.

    Raises:
        InvalidGradsError: ``like`` is empty, not a sequence, or has an unsupported dtype
            (naming the param).
    """
    if isinstance(like, np.ndarray) or not isinstance(like, Sequence):
        raise InvalidGradsError(
            f"like must be a sequence (list or tuple) of arrays, got {type(like).__name__}"
        )
    if not like:
        raise InvalidGradsError("like is empty: pass at least one array")
    arrays = [_as_array(x, i) for i, x in enumerate(like)]
    return tuple((check_dtype(a.dtype, f"param {i}").str, a.shape) for i, a in enumerate(arrays))


def _as_array(x: object, i: int) -> np.ndarray:
    """``buffers_like``'s param ``i`` as an array (only its shape and dtype are used)."""
    try:
        return np.asarray(x)
    except Exception as exc:  # torch: a tensor that requires grad, a bfloat16 tensor
        raise InvalidGradsError(
            f"param {i} ({type(x).__name__}) cannot be read as a numpy array: "
            f"{type(exc).__name__}: {exc} (for torch: p.detach().numpy() of a float16/32/64 "
            "tensor)"
        ) from exc
