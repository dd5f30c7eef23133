"""A job's life in the sync directory.

- rendezvous: forming a job (the entry point), and the protocol on disk
- joiner, leader: the two sides of it (rank > 0, rank 0)
- decisions: what each side does next, as pure functions of what it has seen
- failures: the words of every error a rendezvous raises
- generation: a formed job, and a rank leaving it
- leaderlock: one rank 0 per run id; one live claimant per rank
- liveness: whether a member lives (``judge``), heartbeats
- notes: the job's small JSON files, read and written in one place
- reaping: removing what dead runs left
"""
