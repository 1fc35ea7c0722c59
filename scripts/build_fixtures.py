"""Build the fixture checkpoints; same options as `python -m specgate.vllmside.fixtures`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specgate.vllmside.fixtures import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
