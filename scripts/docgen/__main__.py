"""`python -m scripts.docgen --out DIR [PAGE.md ...]`: what tests/docs/ checks, in one process.

Writes the reference pages under DIR (as `scripts/gen_reference.py --out DIR` does) and prints, as
JSON, the check of the commands each page shows (scripts/docgen/doc_commands.py; default: the README
and docs/**/*.md). Both import every command and run it up to its parser, so they share the imports.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from scripts import gen_reference
from scripts.docgen import doc_commands
from scripts.docgen.sources import ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write the reference pages into")
    parser.add_argument("pages", nargs="*", help="Markdown pages whose commands to check")
    args = parser.parse_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    gen_reference.write(gen_reference.render_all(), pathlib.Path(args.out))
    pages = [ROOT / p for p in args.pages] or doc_commands.pages()
    print(json.dumps(doc_commands.check_pages(pages), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
