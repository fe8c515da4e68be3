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
