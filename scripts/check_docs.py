#!/usr/bin/env python3
"""Checks that what README.md and docs/*.md point at exists (`make check-docs`).

- Relative links `[text](path#anchor)` name a file or folder inside the repository,
  and an anchor names a heading of the target (GitHub's slugs).
- Repository paths in code (`src/...`, `scripts/...`, `configs/...`, ...) exist; a
  path with `*` must match something.
- `make X` names a target of the Makefile.
- `vrtspike SUB [SUBSUB] --flag` names a real subcommand and a real long flag of it,
  and `vrtspike-launch --flag` a real flag of the launcher (flags after a bare `--`
  are `vrtspike train`'s). The commands are read from the clap definitions in
  src/main.rs, src/cli/*.rs, crates/data/src/cli/*.rs (`cache` and `bench`) and
  launcher/src/args.rs, so the check runs before any build.
- `cargo test --test NAME` and `cargo bench --bench NAME` name real targets.

Code is what sits in `code spans` and fenced blocks; prose is not checked for
commands. Prints one line per problem (`FILE:LINE: ...`) and exits 1 if any.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from dataclasses import dataclass, field

# Top-level folders whose paths in code must exist.
REPO_ROOTS = ("src/", "crates/", "launcher/", "scripts/", "configs/", "tests/", "docs/",
              "benches/", "build/", ".ci/")
# Placeholders in a path: `<N>`, `{a,b}`, `...`, `$VAR`, `[...]`.
PLACEHOLDER = re.compile(r"[<>{}$\[\]]|\.\.\.")
ALWAYS_FLAGS = {"--help", "--version", "-h", "-V"}


@dataclass
class Problem:
    doc: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.message}"


# ---------------------------------------------------------------- the binaries


@dataclass
class Command:
    """A clap command: its long flags, or its subcommands (by name)."""

    flags: set[str] = field(default_factory=set)
    subcommands: dict[str, "Command"] = field(default_factory=dict)
    # Hidden subcommands a user never types (`bench cache-worker`, `h5-probe`) are
    # still real, so docs may name them.


def kebab(name: str) -> str:
    """`StopAfterSteps` / `stop_after_steps` -> `stop-after-steps`."""
    name = re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", name)
    return name.replace("_", "-").lower()


@dataclass
class RustItems:
    """The structs and enums of some Rust files, as clap sees them."""

    structs: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    enums: dict[str, list[tuple[str, str, list[tuple[str, str]]]]] = field(default_factory=dict)
    # Names defined in more than one file: resolving them by name alone could pick
    # the wrong one, so using one is an error of this script, not of the docs.
    ambiguous: set[str] = field(default_factory=set)


ATTR = re.compile(r"^\s*#\[(.*)\]\s*$")
STRUCT = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?struct\s+(\w+)")
ENUM = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?enum\s+(\w+)")
FIELD = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:\s*(.+?),?\s*$")
VARIANT = re.compile(r"^\s*(\w+)\s*(\(([^)]*)\)|\{)?\s*,?\s*$")


def attr_flag(attrs: list[str], field_name: str) -> str | None:
    """The long flag an `#[arg(...)]` gives a field, if any."""
    for attr in attrs:
        if not attr.startswith("arg("):
            continue
        named = re.search(r'\blong\s*=\s*"([^"]+)"', attr)
        if named:
            return "--" + named.group(1)
        if re.search(r"\blong\b", attr):
            return "--" + kebab(field_name)
    return None


def is_flatten(attrs: list[str]) -> bool:
    return any(re.match(r"(command|clap)\(.*\bflatten\b", a) for a in attrs)


def command_name(attrs: list[str], variant: str) -> str:
    for attr in attrs:
        named = re.search(r'\bname\s*=\s*"([^"]+)"', attr)
        if attr.startswith("command(") and named:
            return named.group(1)
    return kebab(variant)


def parse_rust(paths: list[str]) -> RustItems:
    """Struct fields (`--flag` or `flatten:Type`) and enum variants (name, type,
    inline fields) of the files: a line-based reading of rustfmt-formatted code."""
    items = RustItems()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            m_struct, m_enum = STRUCT.match(line), ENUM.match(line)
            if m_struct and line.rstrip().endswith("{"):
                body, i = block(lines, i)
                name = m_struct.group(1)
                if name in items.structs or name in items.enums:
                    items.ambiguous.add(name)
                items.structs[name] = fields_of(body)
                continue
            if m_enum and line.rstrip().endswith("{"):
                body, i = block(lines, i)
                name = m_enum.group(1)
                if name in items.structs or name in items.enums:
                    items.ambiguous.add(name)
                items.enums[name] = variants_of(body)
                continue
            i += 1
    return items


def block(lines: list[str], start: int) -> tuple[list[str], int]:
    """The lines inside the braces opened on line `start`, and the line after."""
    depth = 0
    body = []
    for j in range(start, len(lines)):
        text = re.sub(r'"(?:\\.|[^"\\])*"', '""', lines[j].split("//")[0])
        if j > start:
            body.append(lines[j])
        depth += text.count("{") - text.count("}")
        if depth == 0:
            return body[:-1], j + 1
    return body, len(lines)


def fields_of(body: list[str]) -> list[tuple[str, str]]:
    """(`--flag` | `flatten:Type`, field) for each field at the top level of a body."""
    out = []
    attrs: list[str] = []
    depth = 0
    for line in body:
        stripped = line.strip()
        if depth == 0:
            m_attr = ATTR.match(line)
            if m_attr:
                attrs.append(m_attr.group(1))
            elif stripped.startswith("///") or not stripped:
                pass
            else:
                m_field = FIELD.match(line)
                if m_field:
                    name, ty = m_field.group(1), m_field.group(2)
                    if is_flatten(attrs):
                        out.append(("flatten:" + re.sub(r"\W.*", "", ty), name))
                    else:
                        flag = attr_flag(attrs, name)
                        if flag:
                            out.append((flag, name))
                attrs = []
        depth += stripped.count("{") - stripped.count("}")
    return out


def variants_of(body: list[str]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(subcommand name, payload type or '', inline fields) for each variant."""
    out = []
    attrs: list[str] = []
    i = 0
    while i < len(body):
        line = body[i]
        stripped = line.strip()
        m_attr = ATTR.match(line)
        if m_attr:
            attrs.append(m_attr.group(1))
            i += 1
            continue
        if stripped.startswith("///") or not stripped:
            i += 1
            continue
        m_var = VARIANT.match(line)
        if m_var:
            name = command_name(attrs, m_var.group(1))
            subcommand = any(re.match(r"command\(.*\bsubcommand\b", a) for a in attrs)
            if m_var.group(2) == "{":
                inner, i = block(body, i)
                out.append((name, "", fields_of(inner)))
            else:
                payload = (m_var.group(3) or "").split("::")[-1].strip()
                out.append((name, ("sub:" if subcommand else "") + payload, []))
                i += 1
        else:
            i += 1
        attrs = []
    return out


def build_command(items: RustItems, type_name: str, seen: frozenset = frozenset()) -> Command:
    """The clap command that `type_name` (an Args struct or a Subcommand enum) is."""
    command = Command()
    if type_name in items.ambiguous:
        raise SystemExit(f"check_docs: {type_name} is defined in more than one file; "
                         "teach scripts/check_docs.py to resolve it by module")
    if type_name in seen:
        return command
    seen = seen | {type_name}
    if type_name in items.structs:
        for flag, _ in items.structs[type_name]:
            if flag.startswith("flatten:"):
                command.flags |= build_command(items, flag[len("flatten:"):], seen).flags
            else:
                command.flags.add(flag)
    elif type_name in items.enums:
        for name, payload, inline in items.enums[type_name]:
            if inline:
                sub = Command(flags={f for f, _ in inline if not f.startswith("flatten:")})
            elif payload:
                sub = build_command(items, payload.removeprefix("sub:"), seen)
            else:
                sub = Command()
            command.subcommands[name] = sub
    return command


def load_binaries(root: str) -> tuple[Command, Command]:
    """`vrtspike` (from src/main.rs, src/cli/ and the data crate's cli/) and
    `vrtspike-launch`."""
    cli = sorted(glob.glob(os.path.join(root, "src/cli/*.rs"))
                 + glob.glob(os.path.join(root, "crates/data/src/cli/*.rs")))
    vrtspike = build_command(parse_rust([os.path.join(root, "src/main.rs")] + cli), "Command")
    launcher = build_command(parse_rust([os.path.join(root, "launcher/src/args.rs")]), "Args")
    if not vrtspike.subcommands or "train" not in vrtspike.subcommands:
        raise SystemExit("check_docs: found no `vrtspike` subcommands in src/main.rs (parser out of date?)")
    if "--config" not in launcher.flags:
        raise SystemExit("check_docs: found no `vrtspike-launch` flags in launcher/src/args.rs (parser out of date?)")
    return vrtspike, launcher


def make_targets(root: str) -> set[str]:
    targets = set()
    with open(os.path.join(root, "Makefile"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_./$()-][^:=#\t]*?)\s*:(?![=:])", line)
            if m and not line.startswith("\t"):
                targets.update(t for t in m.group(1).split() if "$" not in t and "/" not in t)
    return targets - {".PHONY"}


def cargo_targets(root: str) -> tuple[set[str], set[str]]:
    """Names of integration test and bench targets of the workspace."""
    tests, benches = set(), set()
    for base in (root, os.path.join(root, "crates/data"), os.path.join(root, "launcher")):
        for p in glob.glob(os.path.join(base, "tests/*.rs")):
            tests.add(os.path.basename(p)[:-3])
        for p in glob.glob(os.path.join(base, "tests/*/main.rs")):
            tests.add(os.path.basename(os.path.dirname(p)))
        for p in glob.glob(os.path.join(base, "benches/*.rs")):
            benches.add(os.path.basename(p)[:-3])
        toml = os.path.join(base, "Cargo.toml")
        if os.path.isfile(toml):
            with open(toml, encoding="utf-8") as f:
                text = f.read()
            for kind, names in (("test", tests), ("bench", benches)):
                for section in re.findall(r"\[\[%s\]\]([^\[]*)" % kind, text):
                    m = re.search(r'name\s*=\s*"([^"]+)"', section)
                    if m:
                        names.add(m.group(1))
    return tests, benches


# ---------------------------------------------------------------- the docs


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_fence = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
                continue
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m and not in_fence:
                base = slug(m.group(1))
                n = counts.get(base, 0)
                found.add(base if n == 0 else f"{base}-{n}")
                counts[base] = n + 1
    return found


@dataclass
class Doc:
    path: str  # relative to the root
    prose: list[tuple[int, str]]  # (line, text outside code)
    code: list[tuple[int, str]]  # (line, a code span or a fenced line)


INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def read_doc(root: str, rel: str) -> Doc:
    doc = Doc(rel, [], [])
    in_fence = False
    pending = ""
    pending_line = 0
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
                continue
            if in_fence:
                text = re.sub(r"^\s*\$\s+", "", line)
                if pending:
                    text = pending + " " + text.strip()
                    number = pending_line
                if text.rstrip().endswith("\\"):
                    pending, pending_line = text.rstrip()[:-1], number
                    continue
                pending = ""
                doc.code.append((number, re.sub(r"\s#\s.*$", "", text)))
                continue
            doc.prose.append((number, INLINE_CODE.sub(" ", line)))
            for m in INLINE_CODE.finditer(line):
                doc.code.append((number, m.group(2).strip()))
    return doc


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\s*\[[^\]]+\]:\s*(\S+)")


def check_links(root: str, doc: Doc) -> list[Problem]:
    problems = []
    here = os.path.dirname(os.path.join(root, doc.path))
    for number, text in doc.prose:
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(root, doc.path)
            if os.path.relpath(full, root).startswith(".."):
                problems.append(Problem(doc.path, number, f"link {target!r} leaves the repository"))
                continue
            if not os.path.exists(full):
                problems.append(Problem(doc.path, number, f"link {target!r}: no such file or folder"))
                continue
            if anchor and full.endswith(".md") and anchor not in anchors(full):
                problems.append(Problem(doc.path, number, f"link {target!r}: no heading with anchor #{anchor} in {os.path.relpath(full, root)}"))
    return problems


def check_paths(root: str, doc: Doc) -> list[Problem]:
    problems = []
    for number, code in doc.code:
        for token in re.split(r"[\s,;()|'\"=]+", code):
            token = token.rstrip(".:")
            if not token.startswith(REPO_ROOTS) or PLACEHOLDER.search(token):
                continue
            full = os.path.join(root, token)
            exists = bool(glob.glob(full)) if "*" in token else os.path.exists(full)
            if not exists:
                problems.append(Problem(doc.path, number, f"path {token!r} does not exist"))
    return problems


# `make` as a command: at the start of the code, or after a shell operator (so a
# quoted message such as `... make target and ...` is not read as one).
MAKE = re.compile(r"(?:^|[;&|(]\s*)make\s+([^;&|#]*)")


def check_make(doc: Doc, targets: set[str]) -> list[Problem]:
    problems = []
    for number, code in doc.code:
        for m in MAKE.finditer(code):
            words = re.sub(r"\[[^\]]*\]|<[^>]*>", " ", m.group(1))
            for token in words.split():
                if "=" in token or token.startswith("-"):
                    continue  # VAR=value, make's own options
                if not re.fullmatch(r"[a-z][a-z0-9_-]*", token):
                    break
                if token not in targets:
                    problems.append(Problem(doc.path, number, f"`make {token}`: no such target in the Makefile"))
    return problems


# The binaries, alone or with a real path (`target/release/vrtspike`); a path with a
# placeholder (`.../vrtspike`) quotes a message, not a command.
BINARY = re.compile(r"(?:^|[\s;&|(`])((?:[\w.-]*/)*)(vrtspike-launch|vrtspike)(?=\s|$)")
COMMAND_END = re.compile(r"\s(?:\||&&|;|>|2>|#)\s")


def flag_tokens(text: str) -> list[str]:
    """`--flag` tokens of a command, without values, brackets or alternatives."""
    flags = []
    for token in re.split(r"[\s\[\]()|]+", text):
        m = re.match(r"^(--?[A-Za-z][A-Za-z0-9-]*)", token)
        if m and not re.match(r"^-\d", token):
            flags.append(m.group(1))
    return flags


def check_launcher_command(words: str, vrtspike: Command, launcher: Command) -> list[str]:
    """What is wrong with `vrtspike-launch words...` (after a bare `--`: `vrtspike
    train`'s flags)."""
    own, _, rest = (" " + words + " ").partition(" -- ")
    errors = [f"`vrtspike-launch {flag}`: no such flag"
              for flag in flag_tokens(own) if flag not in launcher.flags | ALWAYS_FLAGS]
    train = vrtspike.subcommands["train"]
    errors += [f"`vrtspike-launch ... -- {flag}`: `vrtspike train` has no such flag"
               for flag in flag_tokens(rest) if flag not in train.flags | ALWAYS_FLAGS]
    return errors


def check_vrtspike_command(words: str, vrtspike: Command) -> list[str]:
    """What is wrong with `vrtspike words...`: the subcommand path, then its flags."""
    tokens = words.split()
    command, path = vrtspike, ["vrtspike"]
    rest = tokens
    while command.subcommands and rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]):
        if rest[0] not in command.subcommands:
            known = ", ".join(sorted(command.subcommands))
            return [f"`{' '.join(path)} {rest[0]}`: no such subcommand (known: {known})"]
        command = command.subcommands[rest[0]]
        path.append(rest[0])
        rest = rest[1:]
    # A group named without its subcommand takes only --help.
    allowed = ALWAYS_FLAGS if command.subcommands else command.flags | ALWAYS_FLAGS
    return [f"`{' '.join(path)} {flag}`: no such flag"
            for flag in flag_tokens(" ".join(rest)) if flag not in allowed]


def check_command(words: str, vrtspike: Command, launcher: Command, binary: str) -> list[str]:
    """What is wrong with `binary words...`."""
    if binary == "vrtspike-launch":
        return check_launcher_command(words, vrtspike, launcher)
    return check_vrtspike_command(words, vrtspike)


def check_commands(doc: Doc, vrtspike: Command, launcher: Command,
                   tests: set[str], benches: set[str]) -> list[Problem]:
    problems = []
    for number, code in doc.code:
        for m in BINARY.finditer(code):
            if "..." in m.group(1):
                continue
            # `cargo test -p vrtspike-launch ...` names a package, not a command.
            if re.search(r"(?:^|\s)(?:-p|--package)$", code[: m.start(1)].rstrip()):
                continue
            words = code[m.end():]
            end = COMMAND_END.search(" " + words + " ")
            if end:
                words = (" " + words)[: end.start()]
            for error in check_command(words.strip(), vrtspike, launcher, m.group(2)):
                problems.append(Problem(doc.path, number, error))
        for kind, names in (("test", tests), ("bench", benches)):
            for m in re.finditer(r"cargo (?:test|bench)\b.*?--%s[ =](\S+)" % kind, code):
                if re.fullmatch(r"[A-Z_]+|<.*>", m.group(1)):
                    continue  # a placeholder: `--test NAME`
                if m.group(1) not in names:
                    problems.append(Problem(doc.path, number, f"`cargo ... --{kind} {m.group(1)}`: no such {kind} target"))
    return problems


def docs_of(root: str) -> list[str]:
    found = ["README.md"] + sorted(
        os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs/*.md")))
    return [p for p in found if os.path.isfile(os.path.join(root, p))]


def check(root: str) -> tuple[list[Problem], int]:
    vrtspike, launcher = load_binaries(root)
    targets = make_targets(root)
    tests, benches = cargo_targets(root)
    problems: list[Problem] = []
    files = docs_of(root)
    for rel in files:
        doc = read_doc(root, rel)
        problems += check_links(root, doc)
        problems += check_paths(root, doc)
        problems += check_make(doc, targets)
        problems += check_commands(doc, vrtspike, launcher, tests, benches)
    return problems, len(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the repository root (default: this script's repository)")
    args = parser.parse_args()
    problems, count = check(args.root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"docs: {len(problems)} problem(s) in {count} files: fix the doc, or the name it points at")
        return 1
    print(f"docs: {count} files, every link, path, make target and command exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
