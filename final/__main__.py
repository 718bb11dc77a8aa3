"""`python -m final ...` is the `final` command (the console script's entry point, for a venv without it on PATH)."""

from final.cli import main

raise SystemExit(main())
