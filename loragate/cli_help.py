"""The plain help every ``gateway`` command prints: usage, description, then its arguments,
options and subcommands, each option as its names and metavar in words (``--url URL``, not
``<str>``) with its help indented beneath (as ``vllm serve --help`` and git do).

Plain, not rich's boxed tables: a table cut ``--pretrained-model-name-or-path`` to
``--pretrai…`` at 80 columns (a script that read the help dropped the flag), broke sentences
mid-line, and looked unlike ``gateway serve``'s. Here a line breaks only at a space, so no
flag, URL or path is ever cut, at any width.
"""

from __future__ import annotations

import inspect
import shutil
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from loragate.cli_tables import WIDEST

OPTIONS = "Options"
_HELP_INDENT = 6
# An option's value in words, by its type's name, where the option gives no metavar.
_TYPE_WORDS = {"integer": "INT", "int": "INT", "float": "NUMBER", "path": "PATH"}


class _PlainHelp:
    usage_tail = ""  # after the usage's pieces (``serve``: its engine's arguments)
    panels: Sequence[str] = (OPTIONS,)  # the sections, in order; the first is the default

    def more_envvars(self, option: Any) -> list[str]:
        """Variables that set ``option`` besides its own (``serve``: the setting's)."""
        return []

    def format_help(self, ctx: Any, formatter: Any) -> None:  # a click Context, HelpFormatter
        formatter.write(format_help(self, ctx))


class PlainCommand(_PlainHelp, TyperCommand):
    """A ``gateway`` command whose help is ``format_help``'s."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``[OPTIONS] NAME SOURCE``: each argument in words (typer writes ``{name}``), in
        brackets when it may be left out; also the usage a usage error prints."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                word = argument_metavar(param)
                word += "..." if param.nargs < 0 else ""
                pieces.append(word if param.required else f"[{word}]")
        return pieces


class PlainGroup(_PlainHelp, TyperGroup):
    """A group of ``gateway`` commands (the root, ``adapters``, ``models``): its help lists
    its commands beneath its options."""


def plain_typer(**settings: Any) -> typer.Typer:
    """A typer app of plain help: its group prints ``format_help``'s (each command is
    registered with ``cls=PlainCommand``), its usage errors are plain lines too."""
    return typer.Typer(
        cls=PlainGroup,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        **settings,
    )


def format_help(command: Any, ctx: Any) -> str:
    """``command``'s help as plain text: usage, description, arguments, then each section's
    options, one per entry: every name and the metavar (wrapped between names, never inside
    one), the help beneath, its default and the environment variables that set it; a
    group's commands last, each with the first sentence of its help."""
    columns = ctx.terminal_width or shutil.get_terminal_size().columns
    width = max(min(columns, ctx.max_content_width or WIDEST, WIDEST), 40)
    pieces = " ".join(command.collect_usage_pieces(ctx))
    lines = _wrap(f"Usage: {ctx.command_path} {pieces}{command.usage_tail}", width, 0, 4)
    for paragraph in inspect.cleandoc(command.help or "").split("\n\n"):
        lines += ["", *_wrap(paragraph, width, 2)]
    params = command.get_params(ctx)
    # typer's own click (typer._click): told apart by kind, not by class.
    arguments = [p for p in params if p.param_type_name == "argument"]
    if arguments:
        lines += ["", "Arguments:"]
        for argument in arguments:
            lines += [f"  {argument_metavar(argument)}"]
            lines += _wrap(getattr(argument, "help", None) or "", width, _HELP_INDENT)
    sections: dict[str, list[Any]] = {}
    for param in params:
        if param.param_type_name == "option" and not param.hidden:
            panel = getattr(param, "rich_help_panel", None) or command.panels[0]
            sections.setdefault(panel, []).append(param)
    order = [*command.panels, *(panel for panel in sections if panel not in command.panels)]
    for panel in (panel for panel in order if panel in sections):
        lines += ["", f"{panel}:"]
        for option in sections[panel]:
            lines += _option_entry(option, width, command.more_envvars)
    subcommands = getattr(command, "commands", {})
    if subcommands:
        lines += ["", "Commands:", *_command_list(subcommands, width)]
    return "\n".join(lines) + "\n"


def _option_entry(option: Any, width: int, more_envvars: Callable[[Any], list[str]]) -> list[str]:
    names = [*option.opts, *option.secondary_opts]
    if option.name == "help":  # `-h, --help` everywhere (typer orders them by the context)
        names.sort(key=lambda name: name.startswith("--"))
    names = [*(f"{name}," for name in names[:-1]), names[-1]]
    if not option.is_flag and not getattr(option, "count", False):
        names.append(option_metavar(option))
    lines = _wrap(" ".join(names), width, 2, 4)
    lines += _wrap(_help_with_default(option), width, _HELP_INDENT)
    own = option.envvar
    envvars = [own] if isinstance(own, str) else list(own or [])
    envvars = list(dict.fromkeys([*envvars, *more_envvars(option)]))
    if envvars:
        lines += _wrap(f"[env: {', '.join(envvars)}]", width, _HELP_INDENT)
    return lines


def argument_metavar(argument: Any) -> str:
    return str(argument.metavar or (argument.name or "").upper())


def option_metavar(option: Any) -> str:
    """The option's value in words: its own metavar, else its type's (``TEXT``, ``INT``,
    ``NUMBER``, ``PATH``)."""
    if option.metavar:
        return str(option.metavar)
    kind = getattr(getattr(option, "type", None), "name", None)  # click's ParamType
    if kind is None:  # typer's own click keeps the annotation instead
        annotation = getattr(getattr(option, "type_descriptor", None), "annotation", None)
        kind = getattr(annotation, "__name__", "")
    return _TYPE_WORDS.get(str(kind).lower(), "TEXT")


def _help_with_default(option: Any) -> str:
    """The option's help and, when it has a default worth saying that the help does not
    say in words, ``(default: ...)``."""
    text = option.help or ""
    default = option.default
    if option.is_flag or default is None or getattr(option, "show_default", None) is False:
        return text
    if "default:" in text.lower() or callable(default) or default in ("", []):
        return text
    return f"{text} (default: {default})"


def _command_list(commands: dict[str, Any], width: int) -> list[str]:
    """Each command's name and the first sentence of its help, in two columns; the help
    wraps beneath its own column."""
    shown = {name: command for name, command in commands.items() if not command.hidden}
    column = max((len(name) for name in shown), default=0) + 4
    lines = []
    for name, command in shown.items():
        short = command.get_short_help_str(limit=width * 4)
        wrapped = textwrap.wrap(
            short,
            width=max(width, column + 20),
            initial_indent=f"  {name}".ljust(column),
            subsequent_indent=" " * column,
            break_long_words=False,
            break_on_hyphens=False,
        )
        lines += wrapped or [f"  {name}"]
    return lines


def _wrap(text: str, width: int, indent: int, later: int | None = None) -> list[str]:
    """``text`` filled to ``width``, breaking only at spaces: a flag, a URL or a path is
    never cut (one longer than the line stands alone on its line)."""
    if not text:
        return []
    return textwrap.wrap(
        " ".join(text.split()),
        width=width,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent if later is None else later),
        break_long_words=False,
        break_on_hyphens=False,
    )
