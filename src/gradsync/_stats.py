"""What one averaging call cost, phase by phase."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """Timings of one averaging call on this rank, in seconds.

    ``download_s`` copies GPU buffers to the host (0 for numpy arrays);
    ``publish_s`` writes this rank's gradients; ``wait_inputs_s`` waits for the
    peers' (``last_rank`` is the one that arrived last, None when there was no
    wait); ``reduce_s`` computes this rank's shard of the mean; ``wait_outputs_s``
    waits for the other shards and ``gather_s`` copies them into the arrays (for GPU
    buffers: queues the copies of every shard into the buffers). ``total_s`` is the
    call from the download (or publish) to the end of the gather: it excludes the
    first call's rendezvous and the argument checks.

    With ``elastic``: ``members`` are the ranks that took part, each as it was started
    (``cfg.rank``), in the order of their ranks now; ``epoch`` counts the changes of
    membership so far; ``lost`` says who left during this call and why (the step was
    then redone without them), or after the averaging call before it: while joiners
    came in, or in a ``broadcast``; ``joined`` lists those admitted after it (call
    ``broadcast`` before the next step). Without ``elastic`` they stay empty.

    ``compression`` names the codec the call's files were compressed with: None
    without ``compression``, and where it was not applied (``compress_local``).
    """

    step: int
    world_size: int
    bytes_per_rank: int
    download_s: float = 0.0
    publish_s: float = 0.0
    wait_inputs_s: float = 0.0
    reduce_s: float = 0.0
    wait_outputs_s: float = 0.0
    gather_s: float = 0.0
    total_s: float = 0.0
    last_rank: int | None = None
    members: tuple[int, ...] = ()
    epoch: int = 0
    lost: tuple[str, ...] = ()
    joined: tuple[int, ...] = ()
    compression: str | None = None

    @classmethod
    def timed(
        cls,
        step: int,
        world_size: int,
        bytes_per_rank: int,
        t: tuple[float, ...],
        last_rank: int | None,
        compression: str | None = None,
    ) -> StepStats:
        """The stats of a step from its clock readings: start, published, inputs in,
        reduced, shards in, gathered."""
        return cls(
            step=step,
            world_size=world_size,
            bytes_per_rank=bytes_per_rank,
            publish_s=t[1] - t[0],
            wait_inputs_s=t[2] - t[1],
            reduce_s=t[3] - t[2],
            wait_outputs_s=t[4] - t[3],
            gather_s=t[5] - t[4],
            total_s=t[5] - t[0],
            last_rank=last_rank,
            compression=compression,
        )

    def __str__(self) -> str:
        return (
            f"step {self.step}: {self.bytes_per_rank} B/rank, total {self.total_s * 1e3:.2f} ms "
            f"({f'download {self.download_s * 1e3:.2f}, ' if self.download_s else ''}"
            f"publish {self.publish_s * 1e3:.2f}, wait {self.wait_inputs_s * 1e3:.2f}"
            f"{'' if self.last_rank is None else f' for rank {self.last_rank}'}, "
            f"reduce {self.reduce_s * 1e3:.2f}, wait {self.wait_outputs_s * 1e3:.2f}, "
            f"gather {self.gather_s * 1e3:.2f})"
        )
