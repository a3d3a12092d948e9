"""Build the documentation site strictly, then check every internal link of the result.

Usage: ``python docs/build.py [--out DIR] [--no-notebooks]``. Warnings are errors (a broken
cross-reference, a public name without a docstring or missing from the API reference, a
notebook cell that fails, a page in no toctree); afterwards every relative ``href`` / ``src``
of the HTML must name a file of the build and, with a ``#fragment``, an id in that file.
Exits non-zero on any failure. ``.ci/run`` runs it after the tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

DOCS = Path(__file__).resolve().parent


class _Links(HTMLParser):
    """The ids of one HTML file and the relative links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.links.append(value)


def check_links(html_dir: Path) -> list[str]:
    """Return one message per internal link of ``html_dir`` that does not resolve."""
    pages: dict[Path, _Links] = {}
    for path in sorted(html_dir.rglob("*.html")):
        if "_static" in path.relative_to(html_dir).parts:
            continue  # the theme's own assets (templates among them)
        parser = _Links()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = parser
    errors = []
    for path, parser in pages.items():
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue  # external: not this check's business (the build needs no network)
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            where = f"{path.relative_to(html_dir.resolve())}: {link}"
            if html_dir.resolve() not in (target, *target.parents):
                errors.append(f"{where}: points outside the site")
            elif target.is_dir():
                if not (target / "index.html").exists():
                    errors.append(f"{where}: a directory without index.html")
            elif not target.exists():
                errors.append(f"{where}: no such file")
            elif parts.fragment and target.suffix == ".html" and target in pages:
                if unquote(parts.fragment) not in pages[target].ids:
                    errors.append(f"{where}: no id {parts.fragment!r} in {target.name}")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "html", help="output directory")
    parser.add_argument("--source", type=Path, default=DOCS, help="source directory (a copy of docs/)")
    parser.add_argument(
        "--no-notebooks", action="store_true", help="render the notebooks without executing them (faster)"
    )
    args = parser.parse_args(argv)
    env = dict(os.environ, MPLBACKEND="Agg", PYDEVD_DISABLE_FILE_VALIDATION="1")
    # The notebook kernels are started as `python`: the one of this environment.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html"]
    if args.no_notebooks:
        command += ["-D", "nb_execution_mode=off"]
    command += [str(args.source), str(args.out)]
    start = time.perf_counter()
    if subprocess.run(command, env=env).returncode != 0:
        print("docs: the build failed (warnings are errors; see above)", file=sys.stderr)
        return 1
    errors = check_links(args.out)
    for error in errors:
        print(f"docs: broken link: {error}", file=sys.stderr)
    if errors:
        return 1
    index = (args.out / "index.html").resolve()
    seconds = time.perf_counter() - start
    print(f"docs: built in {seconds:.0f} s, every internal link resolves; open {index.as_uri()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
