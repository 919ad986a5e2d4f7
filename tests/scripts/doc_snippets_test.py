#!/usr/bin/env python3
"""Checks that every snippet a doc quotes is the file it names, byte for byte (but for trailing
whitespace). A quote is marked by a line `<!-- snippet: path/from/repo/root -->` right before a
fenced code block. Those files are built and run by CI, so the docs' programs cannot rot.

    doc_snippets_test.py REPO_ROOT docs/embedding.md [more docs...]"""
import pathlib
import re
import sys

MARK = re.compile(r"<!-- snippet: (\S+) -->\n```[a-z+]*\n(.*?)\n```", re.S)


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    failures = checked = 0
    for doc in sys.argv[2:]:
        text = (root / doc).read_text(encoding="utf-8")
        for match in MARK.finditer(text):
            checked += 1
            path, quoted = match.group(1), match.group(2)
            actual = (root / path).read_text(encoding="utf-8")
            if quoted.rstrip() != actual.rstrip():
                failures += 1
                print(f"{doc}: the snippet of {path} differs from the file", file=sys.stderr)
    if checked == 0:
        print("no snippets found", file=sys.stderr)
        return 1
    print(f"doc_snippets_test: {checked} snippets match their files")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
