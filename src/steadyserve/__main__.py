"""`python -m steadyserve ...`: the same commands as the `steadyserve` script."""

from .cli import main

raise SystemExit(main())
