"""`python -m steadyserve ...`: the same commands as the `steadyserve` script."""

from .cli import main
from .process_exit import exit_process

exit_process(main())
