"""Every numeric option of every command has an allowed range (``commands/option_ranges.py``),
and every value outside it (below, above, NaN, infinities, a huge integer, hypothesis' draws)
is exit 2 with one ``error:`` line naming the flag, never a traceback. Old code (485cae7):
``generate --kv-cache-gib nan`` / ``inf`` and ``--num-blocks 1e23`` ended in ValueError and
OverflowError tracebacks, ``--tp-timeout-s nan`` was accepted."""

from __future__ import annotations

import math
import typing

import pytest
import typer.main
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.cli import app
from kvledger.commands.option_ranges import COMMAND_RANGES, OPTION_RANGES
from kvledger.engine.config import ENGINE_RANGES


def _numeric(annotation) -> bool:
    args = typing.get_args(annotation)
    return annotation in (int, float) or bool(args) and set(args) <= {int, float, type(None)}


def numeric_options() -> list[tuple[tuple[str, ...], object]]:
    """(command words, click parameter) of every numeric option of every command."""
    out = []

    def walk(command, words):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*words, name))
        if not hasattr(command, "commands"):
            out.extend((words, p) for p in command.params
                       if _numeric(p.type_descriptor.annotation))

    walk(typer.main.get_command(app), ())
    return out


OPTIONS = numeric_options()
CLI = typer.main.get_command(app)  # built once: typer's CliRunner rebuilds it on every call


def _words(command: tuple[str, ...], param) -> list[str]:
    """The command with its required arguments filled in and ``param`` left to add."""
    group = CLI
    for word in command:
        group = group.commands[word]
    needed = []
    for p in group.params:
        if p.required:
            needed += ["x"] if p.param_type_name == "argument" else [p.opts[0], "http://x"]
    return [*command, *needed]


def run(command, param, text: str):
    return CliRunner().invoke(CLI, [*_words(command, param), param.opts[0], text])


def test_every_numeric_option_has_a_range():
    assert len(OPTIONS) > 150
    missing = sorted({p.name for _, p in OPTIONS} - set(OPTION_RANGES))
    assert not missing, f"numeric options without a range: {missing}"


def test_one_meaning_per_name():
    """A command's own table never redefines an engine option's name."""
    assert not set(COMMAND_RANGES) & set(OPTION_RANGES.keys() - COMMAND_RANGES.keys())
    assert len(ENGINE_RANGES) + len(COMMAND_RANGES) == len(OPTION_RANGES)


def bad_texts(allowed) -> list[str]:
    out = ["nan", "inf", "-inf", "1e400"] if not allowed.integer else [str(1 << 70), "-" + "9" * 30]
    if allowed.lo is not None:
        out.append(repr(allowed.lo if allowed.lo_open else allowed.lo - (1 if allowed.integer
                                                                           else 1e-6)))
    if allowed.hi is not None:
        out.append(repr(allowed.hi if allowed.hi_open else allowed.hi + (1 if allowed.integer
                                                                           else 1e-3)))
    return out


def _refused(result, flag: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"error: {flag} must be " in result.output, result.output


@pytest.mark.parametrize(("command", "param"), OPTIONS,
                         ids=[f"{' '.join(c)} {p.opts[0]}" for c, p in OPTIONS])
def test_each_value_out_of_range_is_exit_2_naming_the_flag(command, param):
    allowed = OPTION_RANGES[param.name]
    for text in bad_texts(allowed):
        _refused(run(command, param, text), param.opts[0])


@pytest.mark.parametrize(("command", "param"), [o for o in OPTIONS if o[0] == ("generate",)],
                         ids=lambda o: getattr(o, "name", str(o)))
def test_text_that_is_no_number_is_a_usage_error(command, param):
    result = run(command, param, "many")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert param.opts[0] in result.output


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_out_of_range_values_never_pass(data):
    command, param = data.draw(st.sampled_from(OPTIONS))
    allowed = OPTION_RANGES[param.name]
    below = [] if allowed.lo is None else [st.floats(max_value=allowed.lo, exclude_max=not
                                                     allowed.lo_open, allow_nan=False)]
    above = [] if allowed.hi is None else [st.floats(min_value=allowed.hi, exclude_min=not
                                                     allowed.hi_open, allow_nan=False)]
    values = st.one_of(*below, *above, st.just(math.nan))
    if allowed.integer:
        values = st.one_of(*[st.integers(max_value=math.ceil(allowed.lo) - (0 if allowed.lo_open
                                                                            else 1))][:len(below)],
                           *[st.integers(min_value=math.floor(allowed.hi) + (0 if allowed.hi_open
                                                                             else 1))][:len(above)])
    value = data.draw(values)
    result = run(command, param, str(value))
    if allowed.integer or not math.isnan(value):
        _refused(result, param.opts[0])
    else:
        assert result.exit_code == 2 and "Traceback" not in result.output
