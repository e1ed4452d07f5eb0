#!/usr/bin/env python3
"""The size of the code that is not tests, at any commit (issue 35, item 4).

Non-test lines are the non-blank lines of the `*.rs` files under src/, crates/ and
launcher/, leaving out `tests/` and `benches/` folders, `*_tests.rs` and `tests.rs`
files, and every item marked `#[cfg(test)]` (the attribute through the end of the
item it marks, by brace matching that skips strings, chars and comments).

    scripts/count_lines.py [--rev REV] [--duplicates] [--by-top]

`--rev` counts a commit's tree instead of the working tree (through `git archive`);
`--duplicates` also runs the `duplicates` tool over that tree and counts the pairs
whose both sides are non-test files of src/, crates/ or launcher/.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

ROOTS = ("src", "crates", "launcher")
CFG_TEST = re.compile(r"^\s*#\[cfg\(test\)\]")


def is_test_path(rel: str) -> bool:
    """True where the whole file is test code (by its place or name)."""
    parts = rel.split("/")
    if not rel.endswith(".rs") or parts[0] not in ROOTS:
        return True
    if "tests" in parts[:-1] or "benches" in parts[:-1]:
        return True
    name = parts[-1]
    return name == "tests.rs" or name.endswith("_tests.rs")


def item_end(lines: list[str], start: int) -> int:
    """The index of the line that closes the item starting at `start` (or `;`)."""
    depth = 0
    opened = False
    i = start
    while i < len(lines):
        line = lines[i]
        j = 0
        while j < len(line):
            c = line[j]
            if line.startswith("//", j):
                break
            if c == '"':
                j = skip_string(line, j)
                continue
            if c == "'" and j + 2 < len(line) and (line[j + 2] == "'" or line[j + 1] == "\\"):
                j = line.index("'", j + 2) + 1 if "'" in line[j + 2 :] else len(line)
                continue
            if c == "{":
                depth += 1
                opened = True
            elif c == "}":
                depth -= 1
                if opened and depth == 0:
                    return i
            elif c == ";" and not opened and depth == 0:
                return i
            j += 1
        i += 1
    return len(lines) - 1


def skip_string(line: str, j: int) -> int:
    """The index after the string literal that opens at `j` (or the line's end)."""
    k = j + 1
    while k < len(line):
        if line[k] == "\\":
            k += 2
            continue
        if line[k] == '"':
            return k + 1
        k += 1
    return len(line)


def non_test_lines(text: str) -> int:
    """Non-blank lines outside `#[cfg(test)]` items."""
    lines = text.splitlines()
    count = 0
    i = 0
    while i < len(lines):
        if CFG_TEST.match(lines[i]):
            i = item_end(lines, i + 1) + 1
            continue
        if lines[i].strip():
            count += 1
        i += 1
    return count


def tree_of(rev: str | None, scratch: Path) -> Path:
    """The non-test files of the working tree or of `rev`, copied under `scratch`."""
    tree = scratch / "tree"
    if rev is None:
        top = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
        listed = subprocess.check_output(
            ["git", "ls-files", "-co", "--exclude-standard", *ROOTS], cwd=top, text=True
        ).split()
        for rel in listed:
            if not is_test_path(rel) and (top / rel).is_file():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                (tree / rel).write_bytes((top / rel).read_bytes())
        return tree
    present = subprocess.check_output(["git", "ls-tree", "--name-only", rev], text=True).split()
    archive = scratch / "tree.tar"
    with archive.open("wb") as out:
        roots = [r for r in ROOTS if r in present]
        subprocess.run(["git", "archive", rev, *roots], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and not is_test_path(m.name)]
        tar.extractall(tree, members=members, filter="data")
    return tree


def count_tree(root: Path) -> Counter:
    """Non-test lines per top folder (src, crates/<name>, launcher/<part>)."""
    by_top: Counter = Counter()
    for path in sorted(root.rglob("*.rs")):
        rel = path.relative_to(root).as_posix()
        if is_test_path(rel):
            continue
        parts = rel.split("/")
        top = "/".join(parts[:2]) if parts[0] != "src" else "src"
        by_top[top] += non_test_lines(path.read_text(encoding="utf-8"))
    return by_top


ROW = re.compile(r"^D\d+\s+(\S+?):\d+-\d+\s+~\s+(\S+?):\d+-\d+")


def duplicate_pairs(root: Path) -> tuple[int, list[str]]:
    """Rows of `duplicates` whose both sides are non-test code files."""
    out = subprocess.run(
        ["duplicates", "--repo", str(root), "--most", "200", "--seconds", "120"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    rows = []
    for line in out.splitlines():
        m = ROW.match(line.strip())
        if m and not is_test_path(m.group(1)) and not is_test_path(m.group(2)):
            rows.append(line.strip())
    return len(rows), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="a commit to count instead of the working tree")
    ap.add_argument("--duplicates", action="store_true", help="count duplicate pairs too")
    ap.add_argument("--by-top", action="store_true", help="print the lines per top folder")
    ap.add_argument("--rows", action="store_true", help="print the duplicate rows counted")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = tree_of(args.rev, Path(scratch))
        by_top = count_tree(root)
        if args.by_top:
            for top, n in sorted(by_top.items()):
                print(f"{n:8d}  {top}")
        print(f"non-test lines: {sum(by_top.values())}")
        if args.duplicates:
            n, rows = duplicate_pairs(root)
            if args.rows:
                print("\n".join(rows))
            print(f"duplicate pairs in non-test code: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
