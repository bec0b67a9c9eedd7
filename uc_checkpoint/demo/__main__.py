"""Run the demo: ``python -m uc_checkpoint.demo``."""

from uc_checkpoint.demo.run import main

raise SystemExit(main())
