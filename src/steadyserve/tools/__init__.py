"""Tools that check steadyserve's claims against any deployment: validate and bench."""
