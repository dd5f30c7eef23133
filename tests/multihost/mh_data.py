"""Deterministic gradients shared by the multi-host worker and the test that checks it.

Imported by ``worker.py`` (running inside a simulated host, as a rank started by
``gradsync launch``) and by ``test_multihost.py`` (which recomputes the expected
means with :func:`gradsync.average_host_grads`). Nothing here touches the filesystem.
"""

from __future__ import annotations

import hashlib

import numpy as np

# Several dtypes, an empty param, sizes that do not divide by 4 ranks x 16-element
# alignment, and one param big enough that every rank reduces a real shard.
MIXED: list[tuple[tuple[int, ...], str]] = [
    ((3, 5), "float32"),
    ((7,), "float16"),
    ((0,), "float32"),
    ((10_007,), "float32"),
    ((2, 2, 3), "float64"),
    ((333,), "float16"),
    ((1000,), "float64"),
]


def layout(name: str) -> list[tuple[tuple[int, ...], str]]:
    """``mixed`` or ``f32:<bytes>`` (one float32 param of that many bytes)."""
    if name == "mixed":
        return MIXED
    if name.startswith("f32:"):
        return [((int(name[4:]) // 4,), "float32")]
    raise ValueError(f"unknown layout {name!r}")


def grads_for(seed: int, rank: int, step: int, layout_name: str = "mixed") -> list[np.ndarray]:
    """Rank- and step-dependent gradients spanning many orders of magnitude.

    ``layout_name`` may be ``cycle:<name>+<name>...``: step k takes the k-th name,
    round robin, so the layout changes from step to step.

    The wide range makes the rounding of the mean depend on the order of the
    additions, so a bit-identical check really checks the reduction order.
    """
    if layout_name.startswith("cycle:"):
        names = layout_name[len("cycle:") :].split("+")
        layout_name = names[step % len(names)]
    rng = np.random.default_rng([seed, rank, step, 4242])
    out = []
    for shape, dtype in layout(layout_name):
        scale = 10.0 ** rng.integers(-3, 4, size=shape) if shape != (0,) else 1.0
        out.append((rng.standard_normal(shape) * scale).astype(dtype))
    return out


def digest(arrays: list[np.ndarray]) -> str:
    """SHA-256 of every param's raw bytes, shape and dtype."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
