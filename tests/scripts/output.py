"""Write distinct lines to stdout and stderr, undecodable bytes, and a partial last line."""

import os
import sys

rank = os.environ["RANK"]
print(f"out line 1 of rank {rank}")
print(f"err line 1 of rank {rank}", file=sys.stderr)
print(f"out line 2 of rank {rank}")
sys.stdout.flush()
sys.stdout.buffer.write(b"bytes \xff\xfe end\n")
sys.stdout.buffer.flush()
sys.stderr.write(f"err partial of rank {rank}")
sys.stdout.write(f"out partial of rank {rank}")
