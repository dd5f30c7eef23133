"""Storage: every operation on the sync dir goes through :class:`api.Store`.

api       the Store interface, the active store, use_store (tests)
posix     PosixStore: today's system calls, relative to directory descriptors
faulty    FaultyStore: records and fails operations where a test says
files     file operations by path or descriptor over the active store; error messages
dirs      directories below the sync dir by handle, marked ones, a generation's steps
read      a job's small files and listings, never through a link
makedir   making the sync dir, or saying why it cannot be
"""
