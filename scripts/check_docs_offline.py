"""Check that the built documentation site works offline and that its maths renders.

Run by the ``docs`` nox session after ``sphinx-build``::

    python scripts/check_docs_offline.py docs/_build/html

1. No page loads a script, style sheet or image from another host (a CDN): every
   ``src=`` and ``<link href=`` of every page is relative, and MathJax is in the site.
2. The maths page, opened in headless Chromium from a local web server (no other network
   needed), typesets its formulas: the rendered page holds MathJax's ``<mjx-container>``
   elements, one per formula, and no raw ``$$`` left in the text. Chromium is needed where
   ``ATTNFLOW_REQUIRE_BROWSER=1`` (as in ``.ci/run``); elsewhere this step says it was
   skipped.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

REMOTE = re.compile(r"""(?:<script[^>]*\ssrc|<link[^>]*\shref|<img[^>]*\ssrc)=["'](?:https?:)?//""")
MIN_FORMULAS = 100  # docs/maths.md has about 270 formulas; far fewer means MathJax failed


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site without a log line per file."""

    def log_message(self, format: str, *args: object) -> None:
        """Say nothing."""


def check_no_remote_assets(site: Path) -> None:
    """Fail if a page loads an asset from another host or MathJax is not in the site."""
    pages = sorted(site.rglob("*.html"))
    offenders = [str(p.relative_to(site)) for p in pages if REMOTE.search(p.read_text("utf-8"))]
    if offenders:
        sys.exit(f"pages load assets from another host: {offenders[:10]}")
    mathjax = site / "_static" / "mathjax" / "tex-chtml.js"
    if not mathjax.is_file():
        sys.exit(f"MathJax is not in the site: {mathjax} is missing")
    print(f"{len(pages)} pages load nothing from another host; MathJax is at {mathjax}")


def check_maths_renders(site: Path) -> None:
    """Fail if the maths page, opened in headless Chromium, does not typeset its formulas."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("ATTNFLOW_REQUIRE_BROWSER") == "1":
            sys.exit("ATTNFLOW_REQUIRE_BROWSER=1 but no chromium on PATH")
        print("skipped the rendering check: no chromium on PATH")
        return
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/maths.html"
        dom = subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--virtual-time-budget=20000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    finally:
        server.shutdown()
    formulas = dom.count("<mjx-container")
    if formulas < MIN_FORMULAS:
        sys.exit(f"maths.html typeset {formulas} formulas in Chromium, expected {MIN_FORMULAS}+")
    print(f"maths.html: {formulas} formulas typeset by the site's own MathJax in Chromium")


if __name__ == "__main__":
    built = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html")
    check_no_remote_assets(built)
    check_maths_renders(built)
