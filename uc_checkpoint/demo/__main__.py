"""Run the demo: ``python -m uc_checkpoint.demo``."""

from .run import main

raise SystemExit(main())
