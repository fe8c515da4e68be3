"""The documentation site builds strictly, offline, and the README's links land on real pages.

`mkdocs build --strict` (mkdocs.yml: every validation at warn) turns each of these into a failure:
a page missing from the nav or a nav entry without its page, a link to a page or an anchor that does
not exist, a link mkdocs cannot resolve. The README is not part of the site (GitHub shows it), so
its relative links are checked here against the files they name, anchors included.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly_without_a_warning(tmp_path):
    site = tmp_path / "site"
    # mkdocs-material prints a banner about MkDocs 2 on every build; it is not a build warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "WARNING" not in log, log
    assert (site / "index.html").is_file() and (site / "benchmarks" / "index.html").is_file()
    # The timeline PNGs reach the site through docs/benchmarks/results (a link to bench/gpu/results).
    for page in (ROOT / "docs").rglob("*.md"):
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text()):
            built = (site / page.parent.relative_to(ROOT / "docs") / image).resolve()
            assert built.is_file(), f"{page}: {image} is not in the built site"


def _anchors(markdown: str) -> set[str]:
    """The ids mkdocs' toc extension gives the headings of a page (its default slugify)."""
    ids = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.MULTILINE):
        text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\s-]", "", text).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", slug))
    return ids


def _readme_links() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in link]


@pytest.mark.parametrize("link", _readme_links())
def test_readme_links_name_files_and_headings_that_exist(link):
    path, _, anchor = link.partition("#")
    target = ROOT / path
    assert target.is_file(), f"README.md links to {path}, which does not exist"
    if anchor:
        assert anchor in _anchors(target.read_text()), f"README.md links to {link}: {path} has no such heading"


def test_readme_stays_short_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    # The two commands, exactly as the Makefile and .ci/run give them.
    assert "    make quickstart     # set-up (first time only), then the embedded default end to end\n" in readme
    assert "    make test           # set-up (first time only), then the whole test suite\n" in readme
