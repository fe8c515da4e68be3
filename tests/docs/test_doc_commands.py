"""Every command the README and the documentation pages show is parsed by the command it calls.

scripts/docgen/doc_commands.py reads the commands of each page's code blocks and has each rlmesh
entry point parse its own (rlmesh ..., python -m services.X ..., deepspeed --module ..., ray job
submit ... -- python -m ..., python bench/x.py ...) without running it, so a renamed or removed
option, subcommand or module fails here with the page, the line and the option. Paths of the
repository that a command names (scripts/, examples/, deploy/, bench/) must exist, and `make`
targets must be in the Makefile. The check runs once per session (conftest.py); each page is a
test of its own.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from scripts.docgen.doc_commands import pages
from services.common.user_errors import run_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [p.relative_to(ROOT).as_posix() for p in pages()]
STALE_COMMANDS = "tests/docs/stale_commands.md"


@pytest.mark.parametrize("page", PAGES)
def test_page_commands_parse(page, docgen):
    problems = docgen["commands"][page]["problems"]
    assert not problems, f"{page}: {len(problems)} command(s) the code does not take:\n" + "\n".join(problems)


def _expectations() -> dict[int, str]:
    """Line of each command of stale_commands.md (its first line) -> its `# expect:` text."""
    expected, start = {}, None
    for number, line in enumerate((ROOT / STALE_COMMANDS).read_text().splitlines(), 1):
        start = start or number
        match = re.search(r"# expect: (.+)$", line)
        if match:
            expected[start] = match.group(1).strip()
        if not line.rstrip().endswith("\\"):
            start = None
    return {n: e for n, e in expected.items() if n > 5}


def test_the_check_names_page_line_and_option_of_each_stale_command(docgen):
    result = docgen["commands"][STALE_COMMANDS]
    expected = _expectations()
    assert len(expected) == 15 and result["commands"] == 15
    for number, expect in expected.items():
        mine = [p for p in result["problems"] if p.startswith(f"{STALE_COMMANDS}:{number}: ")]
        if expect == "parses":
            assert not mine, f"line {number} parses, but the check says {mine}"
        else:
            assert len(mine) == 1 and expect in mine[0], f"line {number}: expected {expect!r}, got {mine}"
    assert len(result["problems"]) == sum(e != "parses" for e in expected.values())


def test_readme_and_site_show_commands_that_reach_the_parsers(docgen):
    """Not vacuous: the pages' commands are parsed by the entry points, not only found."""
    parsed = {page: r["parsed"] for page, r in docgen["commands"].items() if page in PAGES}
    assert parsed["README.md"] >= 1
    assert sum(parsed.values()) >= 50, parsed


# What an evaluation command's placeholders stand for, on the tiny model and data: option -> fixture path.
EVAL_VALUES = {"--pretrain": "model", "--dataset": "data", "--input_key": "prompt", "--label_key": "label"}


def test_the_pages_eval_commands_validate(tiny_model_dir, tiny_data_dir, capsys):
    """Parsing alone takes --n_samples_per_prompt 4 without a temperature; validation does not (n greedy
    samples are one answer n times). Each `rlmesh eval` command of the pages, its model and data put on
    the tiny ones, is checked in full with --dry_run: flags together, data, reward source."""
    from scripts.docgen.doc_commands import commands_of
    from services.coordinator.cli import eval_cli

    local = {"model": str(tiny_model_dir), "data": str(tiny_data_dir / "arith_test.jsonl")}
    commands = [c for page in pages() for c in commands_of(page)[0] if c.tokens[:2] == ["rlmesh", "eval"]]
    assert len(commands) >= 2, [c.text for c in commands]
    for command in commands:
        argv = list(command.tokens[2:])
        for i, token in enumerate(argv[:-1]):
            if token in EVAL_VALUES:
                argv[i + 1] = local.get(EVAL_VALUES[token], EVAL_VALUES[token])
        if "--input_key" not in argv:  # the tiny data's field names
            argv += ["--input_key", "prompt", "--label_key", "label"]
        assert run_command(eval_cli.main, [*argv, "--dry_run"]) == 0, (command.file, command.line,
                                                                      capsys.readouterr().err)
        assert "dry run (eval): nothing was started" in capsys.readouterr().out
