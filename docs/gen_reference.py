"""Writes the reference pages into the site at build time (the mkdocs-gen-files plugin runs this).

Each page comes from docs/docgen.py (beside this file), which raises when something lacks its documentation, so
`make docs` fails instead of publishing a gap.
"""

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docgen.py is a build script beside this one
from docgen import PAGES  # noqa: E402

for path, make in PAGES.items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(make())
