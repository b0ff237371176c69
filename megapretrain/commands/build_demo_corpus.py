#!/usr/bin/env python
"""Write a small real-text corpus for demos and smoke tests: the Python standard library's sources.

    python tools/build_demo_corpus.py --output demo/corpus.jsonl [--max-mb 40]

One JSON line ``{"text": <file contents>}`` per ``.py`` file under this interpreter's stdlib
directory, in sorted path order (so the corpus is the same on every run of the same Python),
skipping site-packages, empty files and files that are not valid UTF-8, until ``--max-mb`` MB of
text. Needs no network and no downloads.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator

from megapretrain.cli import ToolParser, positive_float, user_errors

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(root: str) -> Iterator[str]:
    """Paths of the .py files under ``root`` in sorted order, not descending into installed
    packages."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def read_text(path: str) -> str | None:
    """The file's text, or None when it is empty or not valid UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def build_corpus(output: str, max_bytes: int, root: str) -> tuple[int, int]:
    """Write the corpus to ``output`` (via a temporary name); return (documents, text bytes)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    documents = total = 0
    with open(tmp, "w", encoding="utf-8") as out:
        for path in stdlib_sources(root):
            text = read_text(path)
            if text is None:
                continue
            size = len(text.encode("utf-8"))
            if total + size > max_bytes:
                break
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            documents, total = documents + 1, total + size
    os.replace(tmp, output)
    return documents, total


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ToolParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="the .jsonl file to write")
    p.add_argument("--max-mb", type=positive_float, default=40.0,
                   help="stop before the text exceeds this many MB")
    args = p.parse_args(argv)
    root = sysconfig.get_paths()["stdlib"]
    documents, total = build_corpus(args.output, int(args.max_mb * 1e6), root)
    print(f"wrote {args.output}: {documents} documents, {total / 1e6:.1f} MB of text from {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
