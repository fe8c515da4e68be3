"""The generated reference pages (docs/reference/*.md) say what the code says now.

The session's scripts/docgen run (conftest.py) regenerates every page into a temporary folder, as
`python scripts/gen_reference.py` would write them; the committed pages must be the same, byte for
byte, and a page that differs is reported with its changed lines.
"""

from __future__ import annotations

import pathlib

from scripts import gen_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
PAGES = ("index.md", "cli.md", "grpc.md", "metrics.md", "crash-points.md", "errors.md")


def test_committed_reference_pages_are_what_the_code_generates(docgen):
    pages = {p.name: p.read_text() for p in docgen["reference"].glob("*.md")}
    assert sorted(pages) == sorted(PAGES)
    found = gen_reference.differences(pages, REFERENCE)
    assert not found, "the reference pages are stale; run `python scripts/gen_reference.py`:\n\n" + "\n\n".join(found)


def test_a_changed_page_is_reported_with_its_lines(tmp_path):
    pages = {name: (REFERENCE / name).read_text() for name in PAGES}
    gen_reference.write(pages, tmp_path)
    assert gen_reference.differences(pages, tmp_path) == []
    renamed = pages["metrics.md"].replace("`rlmesh_rollout_weight_version`", "`rlmesh_rollout_weights_version`")
    (tmp_path / "old.md").write_text("a page no longer generated\n")
    found = gen_reference.differences(dict(pages, **{"metrics.md": renamed}), tmp_path)
    assert found[0].startswith("metrics.md: 2 changed lines") and "+| `rlmesh_rollout_weights_version`" in found[0]
    assert found[1] == "old.md: not generated any more; delete it"
