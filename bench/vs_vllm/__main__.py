"""``python bench/vs_vllm`` (or ``python -m vs_vllm`` from bench/): run the side-by-side benchmark."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a directory: make the package importable by name
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vs_vllm.cli import main  # noqa: E402

raise SystemExit(main())
