"""The documentation site builds in strict mode: a broken link or anchor, or a page missing from the nav,
fails here (and so in `make test`), not on a reader. The Markdown files read on their own (README.md,
BENCHMARKS.md) link only to files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# [text](target) links that are not URLs; the target's #fragment is dropped.
LOCAL_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def test_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "run-spec" / "index.html").is_file()


@pytest.mark.parametrize("page", ["README.md", "BENCHMARKS.md"])
def test_root_pages_link_to_files_that_exist(page):
    text = (ROOT / page).read_text()
    missing = [t for t in LOCAL_LINK.findall(text) if not (ROOT / t).exists()]
    assert missing == [], f"{page} links to missing files: {missing}"
