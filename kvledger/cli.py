"""The ``kvledger`` command line: plan | models | probe | generate | serve | bench | chat | eval |
replay | calibrate.

Each subcommand lives in ``kvledger/commands/<name>.py`` and imports its heavy dependencies
(torch, transformers, fastapi) inside the function, so ``kvledger plan`` starts without torch.
User mistakes (:class:`kvledger.errors.KVLedgerError`) print one line on stderr and exit 2.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import typer

from kvledger import __version__
from kvledger.commands import (
    bench,
    calibrate,
    chat,
    generate,
    models,
    plan,
    probe,
    replay,
    serve,
)
from kvledger.commands import eval as eval_cmd
from kvledger.commands.option_ranges import check_options
from kvledger.errors import KVLedgerError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="kvledger: an LLM inference engine that knows its KV-cache bill before paying it.",
)


def user_errors(fn: Callable) -> Callable:
    """Wrap a command so a KVLedgerError becomes ``error: <message>`` and exit code 2; its
    numeric options are checked by range first (:mod:`kvledger.commands.option_ranges`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            check_options(kwargs)
            return fn(*args, **kwargs)
        except KVLedgerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper


def _print_version(value: bool) -> None:
    if value:
        print(f"kvledger {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """kvledger: an LLM inference engine that knows its KV-cache bill before paying it."""


app.command("plan")(user_errors(plan.plan))
app.command("models")(user_errors(models.models))
app.command("probe")(user_errors(probe.probe))
app.command("generate")(user_errors(generate.generate))
app.command("serve")(user_errors(serve.serve))
app.command("bench")(user_errors(bench.bench))
app.command("chat")(user_errors(chat.chat))
eval_app = typer.Typer(no_args_is_help=True, help="Quality of a KV choice: perplexity, pass key.")
eval_app.command("perplexity")(user_errors(eval_cmd.perplexity))
eval_app.command("passkey")(user_errors(eval_cmd.passkey))
app.add_typer(eval_app, name="eval")
app.command("calibrate")(user_errors(calibrate.calibrate))
app.command("replay")(user_errors(replay.replay))


if __name__ == "__main__":
    app()
