#!/usr/bin/env python3
"""Copies the regions the docs quote from the compiled files into the docs.

A quote in a Markdown page is a ```cpp block right after a line
`<!-- snippet: <file> <region> -->`; it must equal the lines between
`// [<region>]` and `// [end <region>]` in <file>, less their common
indentation (tests/util/snippets_test.cpp checks it). Run from anywhere:
    scripts/update_snippets.py
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- snippet: (\S+) (\S+) -->$")


def region(path, name):
    lines = (ROOT / path).read_text().split("\n")
    begin = next(i for i, l in enumerate(lines) if l.rstrip().endswith(f"// [{name}]"))
    end = next(i for i, l in enumerate(lines) if i > begin and l.rstrip().endswith(f"// [end {name}]"))
    body = [l.rstrip() for l in lines[begin + 1:end]]
    indent = min(len(l) - len(l.lstrip(" ")) for l in body if l.strip())
    return [l[indent:] if l.strip() else "" for l in body]


def update(page):
    lines = page.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i])
        if m and i + 1 < len(lines) and lines[i + 1] == "```cpp":
            end = next(j for j in range(i + 2, len(lines)) if lines[j] == "```")
            out += ["```cpp"] + region(m.group(1), m.group(2)) + ["```"]
            i = end
        i += 1
    text = "\n".join(out)
    if text != page.read_text():
        page.write_text(text)
        print(f"updated {page.relative_to(ROOT)}")


for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    update(page)
