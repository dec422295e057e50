"""Writes the reference pages into the site at build time (the mkdocs-gen-files plugin runs this).

Each page comes from steadyserve.tools.docgen, which raises when something lacks its documentation, so
`make docs` fails instead of publishing a gap.
"""

import mkdocs_gen_files

from steadyserve.tools.docgen import PAGES

for path, make in PAGES.items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(make())
