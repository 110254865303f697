"""``python -m hybridkv``: the same command line as the ``hybridkv`` script."""

from hybridkv.cli import main

raise SystemExit(main())
