from __future__ import annotations

import sys
from pathlib import Path

# Spawned rank processes import helpers from this directory by module name.
sys.path.insert(0, str(Path(__file__).parent))
