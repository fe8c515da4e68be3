"""docs/reference/cli.md: every command's options, read from the parsers the commands build.

Commands that run the same function (`rlmesh train`, `python -m services.coordinator.train_ppo_ray`,
`rlmesh serve coordinator`, ...) share one section. A command whose options come from a typed
config (services/common/config.py) that takes OpenRLHF 0.11's namespaced names gets their column;
the command veRL's overrides turn into (`rlmesh main_ppo` runs `rlmesh train`) gets veRL's keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from scripts.docgen import entry_points, foreign_names
from scripts.docgen.markdown import anchor, cell, code, page, table

DEFAULT = re.compile(r"\s*\(default: (.*)\)\s*$", re.S)
VERL_COMMANDS = ("rlmesh main_ppo", "python -m services.coordinator.main_ppo")


@dataclasses.dataclass
class Section:
    names: list[str]  # as typed; the first is the title
    body: str  # the options' tables
    description: str = ""  # the first paragraph of the parser's description


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    kind = {int: "int", float: "float"}.get(action.type, "text")
    if action.choices is not None:
        kind = "one of " + ", ".join(str(c) for c in action.choices)
    if action.nargs in ("*", "+"):
        return f"list of {kind}" if action.choices is None else f"list, each {kind}"
    return kind


def _default(action: argparse.Action, help_text: str) -> tuple[str, str]:
    """(default, help without the default): the typed configs state theirs in the help (argparse's is None)."""
    match = DEFAULT.search(help_text)
    if match:
        return match.group(1), help_text[:match.start()]
    if action.default in (None, argparse.SUPPRESS) or action.required:
        return "", help_text
    return str(action.default), help_text


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    return ", ".join(code(s) for s in action.option_strings)


def option_rows(parser: argparse.ArgumentParser, openrlhf: dict | None, verl: dict | None) -> list[list[str]]:
    rows = []
    for action in sorted(parser._actions, key=lambda a: (bool(a.option_strings), a.dest)):
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help_text = parser._get_formatter()._expand_help(action) if action.help else ""
        default, help_text = _default(action, help_text)
        row = [_option(action), cell(_value(action)), code(default), cell(help_text)]
        if openrlhf is not None:
            row.append(", ".join(code(n) for n in openrlhf.get(action.dest, [])))
        if verl is not None:
            row.append(", ".join(code(k) for k in verl.get(action.dest, [])))
        rows.append(row)
    return rows


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def config_class(parser: argparse.ArgumentParser):
    """The typed config (services/common/config.py) whose fields are the parser's options, or None."""
    options = {a.dest for a in parser._actions} - {"help", "config"}
    for module in sorted(list(sys.modules.values()), key=lambda m: m.__name__ if m else ""):
        if module is None or not module.__name__.startswith("services."):
            continue
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                fields = {f.name for f in dataclasses.fields(value) if not f.metadata.get("derived")}
                if fields == options:
                    return value
    return None


def options_body(parser: argparse.ArgumentParser, title: str, verl: dict | None) -> str:
    cls = config_class(parser)
    names = foreign_names.openrlhf_names(cls) if getattr(cls, "OPENRLHF_NAMESPACED", False) else None
    header = ["Option", "Value", "Default", "Description"]
    header += ["OpenRLHF 0.11"] * (names is not None) + ["veRL"] * (verl is not None)
    parts = [table(header, option_rows(parser, names.renamed if names else None, verl))]
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    helps = {a.dest: a.help for a in (sub._choices_actions if sub else [])}
    for name, subparser in sorted((sub.choices if sub else {}).items()):
        rows = option_rows(subparser, None, None)
        what = cell(helps.get(name) or "")
        parts.append(f"#### `{title} {name}`\n\n" + (what[0].upper() + what[1:] + ".\n\n" if what else "")
                     + (table(header[:4], rows) if rows else "No options."))
    if names is not None and names.refused:
        rows = [[code(n), cell(advice)] for n, advice in sorted(names.refused.items())]
        parts.append("OpenRLHF 0.11 options this command refuses, and what to use instead:\n\n"
                     + table(["OpenRLHF 0.11", "What to use instead"], rows))
    unsupported = getattr(cls, "UNSUPPORTED_FLAGS", {})
    if unsupported:
        rows = [[code(f"--{n}"), cell(advice)] for n, advice in sorted(unsupported.items())]
        parts.append("Options of other tools this command refuses, and what to use instead:\n\n"
                     + table(["Option", "What to use instead"], rows))
    return "\n\n".join(parts)


def _heading(section: Section, summaries: dict[str, str]) -> str:
    lines = [f"## `{section.names[0]}`"]
    summary = next((summaries[n] for n in section.names if n in summaries), "")
    summary = summary[0].upper() + summary[1:] + "." if summary else section.description
    if summary:
        lines.append(summary)
    if len(section.names) > 1:
        lines.append("The same command: " + ", ".join(code(n) for n in section.names[1:]) + ".")
    return "\n\n".join(lines)


def verl_body(keys: dict, checked: dict) -> str:
    rows = [[code(key), ", ".join(code(f"--{f}") for f in flags)] for key, flags in keys.items()]
    parts = ["Takes veRL's `key=value` overrides (and `--config-path DIR --config-name NAME`), turns them into "
             "the options of `rlmesh train` (logged in full as `verl.translated`) and runs it; arguments that "
             "start with `--` are `rlmesh train` options, passed on after the translated ones. A key not listed "
             "here is reported in a warning and has no effect.",
             table(["veRL key", "Sets"], rows)]
    rows = [[code(key), cell(advice or "taken; changes none of the options")] for key, advice in checked.items()]
    parts.append("Keys that set no option of their own: a value other than veRL's default is refused with the "
                 "message shown, or taken as veRL means it where the message is empty.\n\n"
                 + table(["veRL key", "A value other than veRL's default"], rows))
    return "\n\n".join(parts)


def rlmesh_section(titles: dict[str, str]) -> str:
    """The subcommands, each linked to the section of its options (titles: command -> its section's title)."""
    from services.cli import COMMANDS, SERVICES

    what = {f"rlmesh serve {s}": f"run the {s} service" for s in SERVICES}
    what |= {f"rlmesh {n}": h for n, (_, _, h) in COMMANDS.items()}
    rows = [[f"[{code(name)}](#{anchor(titles[name])})", cell(text)] for name, text in what.items()]
    return "## `rlmesh`\n\nThe console script; each subcommand's options are below.\n\n" + table(
        ["Command", "What it does"], rows)


def render() -> str:
    from services.cli import COMMANDS, SERVICES

    keys, checked = foreign_names.verl_names()
    verl_parser = entry_points.capture_parser(["rlmesh", "main_ppo", *(f"{k}=X" for k in foreign_names.BASELINE)])
    verl_options = foreign_names.verl_by_option(keys)
    names = entry_points.commands()
    missing = [n for n in VERL_COMMANDS if n not in names]
    assert not missing, f"{missing}: veRL's commands are gone; update VERL_COMMANDS in {__name__}"
    sections: dict[str, Section] = {}  # commands with the same options share a section
    for name in names:
        description = ""
        if name in VERL_COMMANDS:
            body = verl_body(keys, checked)
        else:
            parser = entry_points.capture_parser(name.split())
            verl = verl_options if _dests(parser) == _dests(verl_parser) else None  # what main_ppo runs
            body = options_body(parser, name, verl)
            description = cell((parser.description or "").strip().split("\n\n")[0])
        sections.setdefault(body, Section([], body, description)).names.append(name)
    summaries = {f"rlmesh {name}": help_text for name, (_, _, help_text) in COMMANDS.items()}
    summaries |= {f"rlmesh serve {s}": f"run the {s} service" for s in SERVICES}
    parts = [rlmesh_section({n: s.names[0] for s in sections.values() for n in s.names})]
    parts += [_heading(s, summaries) + "\n\n" + s.body for s in sections.values()]
    intro = """Every command's options, read from the parsers the commands build (a typed config per command,
services/common/config.py, or the command's own argparse parser). Options that take a switch also take
`--no-NAME`; the typed configs also read any option from a YAML file given with `--config FILE`.
A `python -m MODULE` command runs the same way as `deepspeed --module MODULE` or, on a Ray cluster, as
`ray job submit ... -- python -m MODULE`.

The OpenRLHF 0.11 column gives OpenRLHF's namespaced name of an option where the command takes it
(rlmesh's own names are OpenRLHF's names before 0.11); the veRL column gives the `key=value`
overrides of `rlmesh main_ppo` that set it."""
    return page("Commands and options", intro, parts)

