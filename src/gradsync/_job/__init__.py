"""A job's life in the sync directory: rendezvous, liveness, notes, removal."""
