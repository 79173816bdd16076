"""``python -m kvledger``: the same command line as the ``kvledger`` script."""

from kvledger.cli import app

app(prog_name="kvledger")
