"""Print, as one JSON line on stdout, what the launcher gave this rank."""

import json
import os
import sys

NAMES = (
    "GRADSYNC_RANK",
    "GRADSYNC_WORLD_SIZE",
    "GRADSYNC_SYNC_DIR",
    "GRADSYNC_RUN_ID",
    "GRADSYNC_MAX_WAIT_S",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PYTHONUNBUFFERED",
)
sync_dir = os.environ.get("GRADSYNC_SYNC_DIR", "")
report = {
    "env": {name: os.environ.get(name) for name in NAMES},
    "argv": sys.argv[1:],
    "sync_dir_is_dir": os.path.isdir(sync_dir),
}
print("ENV " + json.dumps(report))
