"""Forming a job: every rank registers a fresh nonce, rank 0 admits them into a new generation.

Nothing an earlier run left in the directory can be joined by mistake, and the
user passes no id:

1. Rank r > 0 writes ``rdzv/join-<r>-<nonce>.json`` with a nonce of its own.
2. Rank 0 makes ``gen-<its nonce>/`` and answers every join with
   ``rdzv/offer-<nonce>.json`` naming that generation.
3. A rank that reads an offer for *its* nonce confirms with
   ``gen-<id>/member-<r>-<nonce>.json``. Joins of dead runs get offers too, but
   nobody is left to confirm them.
4. Once every rank has confirmed, rank 0 writes ``gen-<id>/roster.json``; a rank
   whose nonce is not in it lost a race for its rank and says so.

Problems found by rank 0 (two processes for one rank, another live rank 0 with
the same run id, a world-size mismatch) are written to ``gen-<id>/abort.json``
so that every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading

from gradsync._config import FileGradSyncConfig
from gradsync._errors import SyncDirError
from gradsync._names import RDZV
from gradsync._store.dirs import open_below
from gradsync._store.files import DIR_MODE, translate_oserror, warn_if_open
from gradsync._store.makedir import make_sync_dir

from .generation import Generation, calls_finished, leave
from .joiner import join
from .leader import Leader
from .liveness import MemberInfo

__all__ = ["Generation", "calls_finished", "leave", "rendezvous"]


def rendezvous(cfg: FileGradSyncConfig, closing: threading.Event | None = None) -> Generation:
    """Form a new generation with ``cfg.world_size`` live ranks; block until it exists
    (or ``closing`` is set: GradSync.close() from another thread).

    Raises:
        PeerTimeoutError: ranks did not arrive within ``cfg.max_wait_s``; names them.
        PeerLostError: rank 0 died during the rendezvous.
        RendezvousError: a rank is claimed twice, or a live job with the same run id
            already uses the directory.
        MismatchError: ranks were started with different world sizes or settings
            (strategy, wide_sum, check_finite, checksums, the heartbeat's interval and
            timeout).
        SyncDirError: the sync directory cannot be created or written.
        GradSyncError: ``closing`` was set.
    """
    nonce = secrets.token_hex(8)
    me = MemberInfo.for_self(cfg.rank, nonce)
    make_sync_dir(cfg.sync_dir, f"sync_dir {cfg.sync_dir}")
    rdzv = cfg.sync_dir / RDZV
    try:
        cfg.sync_dir.mkdir(DIR_MODE, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(rdzv, DIR_MODE)
        os.close(open_below(cfg.sync_dir, RDZV))  # a link in its place is refused, named
    except SyncDirError:
        raise
    except OSError as exc:
        raise translate_oserror(exc, "creating the rendezvous directory", rdzv) from exc
    warn_if_open(cfg.sync_dir)
    if cfg.rank == 0:
        return Leader(cfg, me, closing).run()
    return join(cfg, me, closing)
