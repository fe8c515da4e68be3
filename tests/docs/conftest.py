"""One run of scripts/docgen for the tests of this folder: the reference pages regenerated into a
temporary folder, and the check of every page's commands (README.md, docs/**/*.md, and
tests/docs/stale_commands.md, the check's own test page). It runs in a process of its own: it
imports every command and runs each up to its parser, which a test process should not share."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from scripts.docgen.doc_commands import pages

ROOT = pathlib.Path(__file__).resolve().parents[2]
STALE_COMMANDS = "tests/docs/stale_commands.md"


@pytest.fixture(scope="session")
def docgen(tmp_path_factory) -> dict:
    """{"reference": folder of the regenerated pages, "commands": {page: {"commands", "parsed", "problems"}}}."""
    out = tmp_path_factory.mktemp("reference")
    names = [p.relative_to(ROOT).as_posix() for p in pages()] + [STALE_COMMANDS]
    run = subprocess.run([sys.executable, "-m", "scripts.docgen", "--out", str(out), *names], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return {"reference": out, "commands": json.loads(run.stdout)}
