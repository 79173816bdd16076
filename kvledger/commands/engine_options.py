"""The engine's command-line options, declared once from :class:`EngineConfig`.

Every field of ``EngineConfig`` becomes one option: the flag is ``--<field-name>`` with dashes
(``num_blocks`` -> ``--num-blocks``) unless :data:`FLAGS` names another, the type and default are
the field's, and the help is the field's entry in the ``Attributes:`` section of the class
docstring (the one place the fields are documented). A field whose default is True is switched
off by a ``--no-...`` flag.

``@engine_options()`` adds the options to a typer command and hands it the built config as its
``engine_config`` parameter; a command that declares a parameter named like a field keeps its
own declaration and still gets the value in the config (``exclude`` leaves fields out).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated

import typer

from kvledger.engine.config import EngineConfig

# fields whose flag is not --<field-name>: a "--no-" flag switches a True field off
FLAGS = {
    "enable_prefix_caching": "--no-prefix-caching",
    "use_kv_cache": "--no-kv-cache",
    "num_threads": "--threads",
}
# more names of a field's flag
ALIASES = {"num_threads": ["--num-threads"], "tensor_parallel_size": ["-tp", "--tp"]}
# fields whose option type is not the field's: speculative_config is JSON on the command line
OPTION_TYPES = {"speculative_config": str | None}
CONFIG_PARAMETER = "engine_config"


def field_help() -> dict[str, str]:
    """Help text of each ``EngineConfig`` field, from the class docstring's ``Attributes:``.

    A field's entry may run over several indented lines; double backticks are dropped.
    """
    doc = inspect.getdoc(EngineConfig) or ""
    block = doc.split("Attributes:", 1)[1].split("\n\n", 1)[0]
    entries: list[list[str]] = []
    for line in block.strip("\n").splitlines():
        if line.startswith("    ") and not line.startswith("     "):
            entries.append([line.strip()])
        elif entries:
            entries[-1].append(line.strip())
    out = {}
    for lines in entries:
        name, _, text = " ".join(lines).partition(": ")
        out[name] = text.replace("``", "")
    return out


def flag(name: str) -> str:
    """The command-line flag of field ``name``."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def _parameter_name(name: str) -> str:
    return flag(name).removeprefix("--").replace("-", "_")


ENGINE_PARAMETERS = {f.name: _parameter_name(f.name) for f in dataclasses.fields(EngineConfig)}
"""``EngineConfig`` field -> the parameter name of its option (``num_threads`` -> ``threads``)."""


def _is_negated(field: dataclasses.Field) -> bool:
    return field.default is True


def _option(field: dataclasses.Field, annotation, help_text: str) -> inspect.Parameter:
    names = [flag(field.name), *ALIASES.get(field.name, [])]
    if _is_negated(field):
        annotation, default, help_text = bool, False, f"Turn off: {help_text}"
    else:
        default = field.default
    return inspect.Parameter(
        _parameter_name(field.name), inspect.Parameter.KEYWORD_ONLY, default=default,
        annotation=Annotated[annotation, typer.Option(*names, help=help_text)],
    )


def engine_options(exclude: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: add every ``EngineConfig`` field (but ``exclude``) as an option of a command
    whose signature has an ``engine_config`` parameter, which receives the built config.

    Raises (when the command runs):
        InvalidParameterError: from ``EngineConfig`` (a size or share out of range).
    """

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = {n: p for n, p in signature.parameters.items() if n != CONFIG_PARAMETER}
        hints = typing.get_type_hints(EngineConfig)
        helps = field_help()
        fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]
        added = [
            _option(f, OPTION_TYPES.get(f.name, hints[f.name]), helps[f.name])
            for f in fields if _parameter_name(f.name) not in own
        ]

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {}
            for f in fields:
                param = _parameter_name(f.name)
                value = kwargs[param] if param in own else kwargs.pop(param)
                values[f.name] = not value if _is_negated(f) else value
            return command(**kwargs, engine_config=EngineConfig(**values))

        wrapper.__signature__ = signature.replace(parameters=[*own.values(), *added])
        return wrapper

    return decorate
