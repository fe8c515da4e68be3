"""Writes the generated reference pages, docs/reference/*.md, from the code.

    .venv/bin/python scripts/gen_reference.py            # rewrite the pages
    .venv/bin/python scripts/gen_reference.py --check    # exit 1 if a committed page differs
    .venv/bin/python scripts/gen_reference.py --out DIR  # write them under DIR instead

Each page is built from what the code holds, never from a copy of it: the commands' parsers
(cli.md), the .proto files compiled by protoc with their comments (grpc.md), the Prometheus
registry after importing the modules that define metrics (metrics.md), the crash and hold point
tables and their call sites (crash-points.md), and the raise sites of the user-error classes
(errors.md). The output depends only on the repository: sorted, without line numbers, times or
paths of this machine, so a page changes only when what it documents changes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "protos"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from scripts.docgen import cli_page, crash_page, errors_page, grpc_page, metrics_page  # noqa: E402
from scripts.docgen.markdown import GENERATED  # noqa: E402
from scripts.docgen.sources import portable  # noqa: E402

PAGES = {
    "cli.md": ("Commands and options", "every command's options, with OpenRLHF's and veRL's names", cli_page.render),
    "grpc.md": ("gRPC API", "every service, RPC and message of protos/", grpc_page.render),
    "metrics.md": ("Prometheus metrics", "every metric the services export", metrics_page.render),
    "crash-points.md": ("Crash and hold points", "the test switches that kill or hold a process at a named moment",
                        crash_page.render),
    "errors.md": ("Error messages", "every message a user error prints, with its fix", errors_page.render),
}
OUT = ROOT / "docs" / "reference"


def index() -> str:
    rows = "\n".join(f"- [{title}]({name}): {what}" for name, (title, what, _) in PAGES.items())
    return (f"# Reference\n\n{GENERATED}\n\nThese pages are generated from the code by "
            "`scripts/gen_reference.py`; `tests/docs/test_reference_pages.py` fails when one of them differs "
            f"from what the code says.\n\n{rows}\n")


def render_all() -> dict[str, str]:
    pages = {name: portable(render()) for name, (_, _, render) in PAGES.items()}
    pages["index.md"] = index()
    return pages


def write(pages: dict[str, str], out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (out / name).write_text(text)


def differences(pages: dict[str, str], out: pathlib.Path) -> list[str]:
    """A summary per page that differs from the one under out (missing, or the changed lines)."""
    found = []
    for name, text in sorted(pages.items()):
        path = out / name
        if not path.is_file():
            found.append(f"{name}: missing")
            continue
        old = path.read_text()
        if old != text:
            diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), f"committed/{name}",
                                             f"generated/{name}", n=0, lineterm=""))
            changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
            found.append(f"{name}: {changed} changed line{'s' if changed != 1 else ''}\n" + "\n".join(diff[:40]))
    stale = sorted(p.name for p in out.glob("*.md") if p.name not in pages) if out.is_dir() else []
    found += [f"{name}: not generated any more; delete it" for name in stale]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed pages; exit 1 if stale")
    parser.add_argument("--out", default=str(OUT), help="folder of the pages (default: docs/reference)")
    args = parser.parse_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC's C core would log each command's fork
    pages = render_all()
    out = pathlib.Path(args.out)
    if args.check:
        found = differences(pages, out)
        if found:
            print("the reference pages are stale; run `python scripts/gen_reference.py`:\n\n" + "\n\n".join(found))
            return 1
        return 0
    write(pages, out)
    for name in sorted(pages):
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
