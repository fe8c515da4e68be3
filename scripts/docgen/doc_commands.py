"""The commands a Markdown page shows, and their check against the commands they call.

Commands are read from fenced code blocks (``` or ~~~, at any indentation, except blocks of a
language that is not a shell: yaml, python, json, ...) and from indented code blocks (four spaces
after a blank line); in blocks of output or synopses (`text`) only the commands' names are checked.
A logical line joins backslash continuations; a `$ ` prompt, comments after `#`, `VAR=value`
prefixes and `env` are dropped, and `&&`, `||`, `;` and `|` split it into commands.

A command that runs an rlmesh entry point (`rlmesh ...`, `python -m services.X ...`,
`deepspeed --module services.X ...`, `ray job submit ... -- python -m services.X ...`,
`python bench/x.py ...`) is parsed by that entry point without running it
(scripts/docgen/entry_points.py). Text that stands for a value is accepted where the option takes
any text; where it takes a number or a choice, a placeholder (`N`, `DIR`, `<steps>`) is given a
valid value; `...` is dropped, optional parts (`[--flag value]`) count as given, and `a|b` means
either (each is checked). A YAML file of the repository given with `--config` / `--run_config` has
its keys parsed as options of the command that reads it. For any command, paths of the repository
it names (scripts/, examples/, deploy/, bench/) must exist, and `make TARGET` must name a target of
the Makefile.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re
import shlex

import yaml

from scripts.docgen import entry_points
from scripts.docgen.sources import ROOT

NOT_SHELL = {"yaml", "yml", "json", "jsonl", "python", "py", "toml", "ini", "proto", "protobuf", "dockerfile",
             "mermaid", "promql", "diff", "csv", "html", "xml", "ebnf"}
# Blocks of program output and synopses (`rlmesh sft|rm|dpo ...   what it does`): only the commands'
# names are checked there.
SYNOPSIS = {"text", "txt", "output", "console-output", "log"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
OPERATORS = {"&&", "||", ";", "|"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"^(<[^>]+>|\{[^}]+\}|[A-Z][A-Z0-9_]*(:[A-Z0-9_]+)?)$")
REPO_PATH = re.compile(r"^(?:\./)?((?:scripts|examples|deploy|bench)/[\w./-]*\w)")
INVALID_VALUE = re.compile(r"argument (\S+): invalid (?:int|float|choice) value: '([^']*)'"
                           r"(?: \(choose from ([^)]*)\))?")


@dataclasses.dataclass
class Command:
    file: str
    line: int
    text: str  # the logical line as the page shows it
    tokens: list[str]  # this command of the line, prompt / env prefix / comments removed
    synopsis: bool = False  # from a block of output or synopses: only the command's name is checked


def code_lines(markdown: str) -> list[tuple[int, str, bool]]:
    """(line number, text, whether the block is output or a synopsis) of every line inside a shell-like
    fenced block or an indented block."""
    out: list[tuple[int, str, bool]] = []
    fence, language, previous_blank, indented = "", "", True, False
    for number, line in enumerate(markdown.splitlines(), 1):
        match = FENCE.match(line)
        if fence:
            if match and match.group(2)[0] == fence[0] and len(match.group(2)) >= len(fence) and not match.group(3):
                fence = ""
            elif language not in NOT_SHELL:
                out.append((number, line.strip(), language in SYNOPSIS))
        elif match:
            fence, language = match.group(2), match.group(3).lower()
        elif line.startswith("    ") and (previous_blank or indented) and line.strip():
            indented = True
            out.append((number, line.strip(), False))
        elif line.strip():
            indented = False
        previous_blank = not line.strip()
    return out


def logical_lines(lines: list[tuple[int, str, bool]]) -> list[tuple[int, str, bool]]:
    """Backslash continuations joined; each with the number of its first line."""
    out: list[tuple[int, str, bool]] = []
    pending: tuple[int, str, bool] | None = None
    last = -1
    for number, text, synopsis in lines:
        if pending is not None and number == last + 1:
            pending = (pending[0], pending[1] + " " + text, synopsis)
        else:
            if pending is not None:
                out.append(pending)
            pending = (number, text, synopsis)
        last = number
        if not pending[1].endswith("\\"):
            out.append(pending)
            pending = None
        else:
            pending = (pending[0], pending[1][:-1].rstrip(), synopsis)
    if pending is not None:
        out.append(pending)
    return out


def split_commands(text: str) -> list[list[str]]:
    """A shell line -> its commands' tokens (prompt, comments, env assignments and `env` dropped)."""
    text = text.removeprefix("$ ")
    tokens = shlex.split(text, comments=True)
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token in OPERATORS:
            commands.append([])
        elif token.endswith(";") and token not in ("\\;",):
            commands[-1].append(token[:-1])
            commands.append([])
        else:
            commands[-1].append(token)
    out = []
    for command in commands:
        while command and (ENV.match(command[0]) or command[0] in ("env", "sudo", "time", "nohup", "exec")):
            command = command[1:]
        if command:
            out.append(command)
    return out


def commands_of(path: pathlib.Path) -> tuple[list[Command], list[str]]:
    """The commands of a page, and the lines that could not be read as shell (file:line: why)."""
    file = _name(path)
    found, unreadable = [], []
    for number, text, synopsis in logical_lines(code_lines(path.read_text())):
        if synopsis:  # the name and what follows, up to a gap before the description column
            tokens = re.split(r"\s{3,}", text, maxsplit=1)[0].split()
            found += [Command(file, number, text, tokens, synopsis=True)] if tokens else []
            continue
        try:
            parts = split_commands(text)
        except ValueError as exc:  # unbalanced quotes
            if _interesting(text):
                unreadable.append(f"{file}:{number}: `{text}`: not a shell line ({exc})")
            continue
        found += [Command(file, number, text, tokens) for tokens in parts]
    return found, unreadable


def _name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _interesting(text: str) -> bool:
    return bool(re.search(r"(^|\s)(rlmesh|-m services\.|--module services\.)", text))


def alternatives(tokens: list[str]) -> list[list[str]]:
    """`a|b` tokens (outside URLs and lists) expanded: each combination once (at most 16)."""
    options = []
    for i, token in enumerate(tokens):
        if "|" in token and "://" not in token and "," not in token and not token.startswith(("'", '"')):
            parts = token.split("|")
            if i > 0 and tokens[i - 1] in ("-m", "--module") and "." in parts[0]:
                parent = parts[0].rsplit(".", 1)[0]  # services.learner.train_sft|train_rm
                parts = [parts[0]] + [p if "." in p else f"{parent}.{p}" for p in parts[1:]]
            options.append(parts)
        else:
            options.append([token])
    return [list(c) for c in itertools.islice(itertools.product(*options), 16)]


def optional_parts(argv: list[str]) -> list[str]:
    """A synopsis's optional parts (`[--placement ray]`) as given: the brackets dropped."""
    out, inside = [], False
    for token in argv:
        bracketed = token.startswith("[-") or (inside and token.endswith("]"))
        if token.startswith("[-"):
            token, inside = token[1:], True
        if inside and token.endswith("]"):
            token, inside = token[:-1], False
        if token or not bracketed:  # "" is a value (`--reward_func ""`); a lone bracket is not
            out.append(token)
    return out


def repo_paths(tokens: list[str]) -> list[str]:
    paths = []
    for token in tokens:
        for piece in (token, token.split("=", 1)[-1]):
            match = REPO_PATH.match(piece)
            if match and not re.search(r"[*<>{}$]|\b[A-Z]{2,}\b", match.group(1)):
                paths.append(match.group(1).split(":")[0])
    return sorted(set(paths))


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text() if (ROOT / "Makefile").is_file() else ""
    return {m.group(1) for m in re.finditer(r"^([\w.-]+)\s*:(?!=)", text, re.M)}


def _yaml_argv(path: pathlib.Path) -> list[str]:
    """A YAML config's keys as command-line options (nested mappings as dotted OpenRLHF names)."""
    argv: list[str] = []

    def add(key: str, value) -> None:
        if isinstance(value, dict):
            for sub, inner in value.items():
                add(f"{key}.{sub}", inner)
        elif value is True:
            argv.append(f"--{key}")
        elif value is False:
            argv.append(f"--no-{key}" if "." not in key else "")
        elif isinstance(value, list):
            argv.extend([f"--{key}", *map(str, value)])
        elif value is not None:
            argv.extend([f"--{key}", str(value)])

    for key, value in (yaml.safe_load(path.read_text()) or {}).items():
        add(str(key).replace("-", "_"), value)
    return [a for a in argv if a]


def _take_option(argv: list[str], name: str) -> tuple[str, list[str]]:
    """(the value of --name, argv without it)."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return "", argv


def _parse(target: entry_points.Target) -> str:
    """'' when the target parses; else its error. Placeholders where a number or a choice is due get
    a valid value (the first choice, or 1) and the argv is parsed again."""
    argv = [a for a in optional_parts(list(target.argv)) if a != "..."]
    for _ in range(len(argv) + 1):
        result = entry_points.parse_only(dataclasses.replace(target, argv=tuple(argv)))
        if result.ok:
            return ""
        match = INVALID_VALUE.search(result.message)
        if not (match and PLACEHOLDER.match(match.group(2)) and match.group(2) in argv):
            return result.message
        choices = [c.strip().strip("'") for c in (match.group(3) or "").split(",") if c.strip()]
        argv[argv.index(match.group(2))] = choices[0] if choices else "1"
    return result.message


def check(command: Command) -> list[str]:
    """What is wrong with one command of a page, as `file:line: ...` lines; [] when it parses."""
    where = f"{command.file}:{command.line}: `{command.text}`"
    problems = [f"{where}: names {p}, which does not exist" for p in repo_paths(command.tokens)
                if not (ROOT / p).exists()]
    if command.tokens[0] == "make":
        targets = make_targets()
        problems += [f"{where}: no target {t} in the Makefile" for t in command.tokens[1:]
                     if not t.startswith("-") and "=" not in t and t not in targets]
    for tokens in alternatives(command.tokens):
        try:
            target = entry_points.resolve(tokens)
        except LookupError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if target is None:
            continue
        checks = _check_name(target) if command.synopsis else _check_target(target)
        problems += [f"{where}: {message}" for message in checks]
    return problems


def _check_name(target: entry_points.Target) -> list[str]:
    """A synopsis line's command exists: the module resolved; `rlmesh X` (`rlmesh serve S`) is a subcommand."""
    from services.cli import COMMANDS, SERVICES

    argv = [a for a in target.argv if not a.startswith("-")]
    if target.command != "rlmesh" or not argv:
        return []
    if argv[0] == "serve":
        return [] if len(argv) > 1 and argv[1] in SERVICES else [f"rlmesh serve: name one of {', '.join(SERVICES)}"]
    return [] if argv[0] in COMMANDS else [f"rlmesh has no command {argv[0]!r}"]


def _check_target(target: entry_points.Target) -> list[str]:
    argv = list(target.argv)
    problems = []
    serve = target.command == "rlmesh" and argv[:1] == ["serve"]
    option = "run_config" if serve else "config"
    value, rest = _take_option(argv, option)
    if serve:
        argv = rest  # `rlmesh serve` reads the file before parsing; its keys are checked here instead
    file = ROOT / value.removeprefix("./") if value else None
    if file is not None and file.is_file() and file.suffix in (".yaml", ".yml"):
        # The file's keys as options of the command that reads it (the coordinator's, for --run_config).
        owner = entry_points.Target("rlmesh", ("train",), module="services.cli") if serve else target
        command = owner.argv[:1] if owner.command == "rlmesh" else ()
        error = _parse(dataclasses.replace(owner, argv=(*command, *_yaml_argv(file))))
        if error:
            problems.append(f"the keys of {value} as options: {error}")
    error = _parse(dataclasses.replace(target, argv=tuple(argv)))
    if error:
        problems.append(error)
    return problems


def runs_entry_point(command: Command) -> bool:
    try:
        return not command.synopsis and entry_points.resolve(command.tokens) is not None
    except LookupError:
        return False


def check_pages(paths: list[pathlib.Path]) -> dict[str, dict]:
    """{page: {"commands": the commands it shows, "parsed": those run by an rlmesh entry point (parsed
    by it), "problems": [...]}}."""
    out = {}
    for path in paths:
        commands, problems = commands_of(path)
        for command in commands:
            problems += check(command)
        out[_name(path)] = {"commands": len(commands), "parsed": sum(map(runs_entry_point, commands)),
                            "problems": problems}
    return out


def pages() -> list[pathlib.Path]:
    """The pages whose commands are checked: the README and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    """`python -m scripts.docgen.doc_commands [PAGE.md ...]`: the problems of each page's commands as
    JSON (default: README.md and docs/**/*.md); exit 1 if any."""
    import json
    import sys

    names = sys.argv[1:] if argv is None else argv
    paths = [ROOT / n for n in names] or pages()
    result = check_pages(paths)
    print(json.dumps(result, indent=1))
    return 1 if any(r["problems"] for r in result.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
