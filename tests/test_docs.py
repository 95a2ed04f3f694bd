"""docs/scheduler.md is the rule book the code and tests cite: every cited rule id has an entry,
every entry names code and tests that exist, and no tracked file points outside the repository.

Reads files only (no model, no build). A rule id is `S<n>` or `P<n>` (one or two digits, upper
case) inside a comment, docstring or string of a tracked file under CITING_DIRS, or `s<n>` /
`p<n>` as a word of a test function's name (`test_s26_...`, `test_p1_p8_...`); a range
`S15-S25` cites every id in it. Not rule ids:
- `P2P` and the like: the digit is followed by a letter, so `\b` never matches there;
- latency percentiles: written `p50`, `p99` in this repository (lower case, not matched);
  upper-case `P50`, `P90`, `P95`, `P99` are excluded by name (NOT_RULES);
- code identifiers: only comments, docstrings and strings are read, so a variable named `S1`
  would not count.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = Path("docs/scheduler.md")
CITING_DIRS = ("tests", "csrc", "baton", "prompt_engine", "completion_engine", "router",
               "kv_transfer")
CPP_SUFFIXES = (".hpp", ".cpp", ".h", ".cc")
PY_SUFFIXES = (".py", ".pyi")
NOT_RULES = frozenset({"P50", "P90", "P95", "P99"})  # latency percentiles
# Pointers to files a clone of the repository does not have.
OUTSIDE = ("SCHEDULER_SPEC", "../shared", "/work/")

_ID = re.compile(r"\b([SP])([0-9]{1,2})\b(?:\s*-\s*(?:\1)?([0-9]{1,2})\b)?")
_TEST_NAME_ID = re.compile(r"(?<=_)([sp])([0-9]{1,2})(?=_|$)")
_DEFINED = re.compile(r"^(?:#{2,6}\s+|\*\*)([SP][0-9]{1,2})\b(?:\*\*)?", re.MULTILINE)
_FILE_NAME = re.compile(r"`([\w./-]+\.(?:hpp|cpp|py|pyi))::(\w+)`")
_PATH = re.compile(r"`((?:csrc|baton|tests|docs|prompt_engine|completion_engine|router|"
                   r"kv_transfer|bench|deploy)/[\w./-]*)`")
_LINK = re.compile(r"\]\(#([\w-]+)\)")


def tracked_files(root: Path, *paths: str) -> list[Path]:
    """Tracked files (relative paths) under `paths`, or the whole tree without any."""
    result = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", *paths],
                            capture_output=True, timeout=60, check=True)
    return [Path(p) for p in result.stdout.decode().split("\0") if p]


def _cpp_text(src: str) -> Iterator[str]:
    """The comments and string literals of C++ source."""
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            yield src[i + 2:j]
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j
            yield src[i + 2:j]
            i = j + 2
        elif src[i] == '"' and i > 0 and src[i - 1] == "R":  # R"delim(...)delim"
            open_paren = src.find("(", i)
            close = ")" + src[i + 1:open_paren] + '"'
            j = src.find(close, open_paren)
            j = n if j < 0 else j
            yield src[open_paren + 1:j]
            i = j + len(close)
        elif src[i] in "\"'":
            if src[i] == "'" and i > 0 and src[i - 1].isalnum():  # digit separator: 1'000
                i += 1
                continue
            quote, j = src[i], i + 1
            while j < n and src[j] != quote and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            yield src[i + 1:j]
            i = j + 1
        else:
            i += 1


def _python_text(src: str) -> Iterator[str]:
    """The comments, strings and docstrings of Python source, and its test functions' names."""
    text_types = {tokenize.COMMENT, tokenize.STRING}
    if hasattr(tokenize, "FSTRING_MIDDLE"):  # Python 3.12+: f-strings come in pieces
        text_types.add(tokenize.FSTRING_MIDDLE)
    after_def = False
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in text_types:
            yield tok.string
        elif tok.type == tokenize.NAME and after_def and tok.string.startswith("test_"):
            yield " ".join(f"{m[0].upper()}{m[1]}" for m in _TEST_NAME_ID.findall(tok.string))
        after_def = tok.type == tokenize.NAME and tok.string == "def"


def cited_ids(text: str) -> set[str]:
    """The rule ids `text` cites, ranges expanded."""
    ids = set()
    for m in _ID.finditer(text):
        first = int(m[2])
        last = int(m[3]) if m[3] else first
        ids.update(f"{m[1]}{n}" for n in range(first, last + 1))
    return ids - NOT_RULES


def citations(root: Path) -> dict[str, list[str]]:
    """Rule id -> the tracked files under CITING_DIRS that cite it."""
    found: dict[str, list[str]] = {}
    for rel in tracked_files(root, *CITING_DIRS):
        if rel.suffix in CPP_SUFFIXES:
            pieces: Iterable[str] = _cpp_text((root / rel).read_text())
        elif rel.suffix in PY_SUFFIXES:
            pieces = _python_text((root / rel).read_text())
        else:
            continue
        for rule in cited_ids("\n".join(pieces)):
            found.setdefault(rule, []).append(str(rel))
    return found


def defined_ids(doc: str) -> list[str]:
    """Rule ids with an entry: a heading `### S12` or a bold lead `**S12**`, one of each."""
    return _DEFINED.findall(doc)


def outside_pointers(root: Path) -> list[str]:
    """`path:line: text` for each line of a tracked file (but this test) that names a file
    outside the repository: the shared scheduler spec, `../shared`, or `/work/`."""
    this = Path(__file__).resolve().relative_to(root.resolve())
    found = []
    for rel in tracked_files(root):
        path = root / rel
        if rel == this or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if any(pointer in line for pointer in OUTSIDE):
                found.append(f"{rel}:{number}: {line.strip()[:160]}")
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _resolve(rel: str) -> Path:
    """A path named in the doc. The C++ is written at its place after the split into
    csrc/scheduler/ and csrc/kernels/; until that lands it is found in csrc/."""
    path = ROOT / rel
    parts = Path(rel).parts
    if not path.exists() and parts[:2] in (("csrc", "scheduler"), ("csrc", "kernels")):
        path = ROOT.joinpath("csrc", *parts[2:])
    return path


@pytest.fixture(scope="module")
def doc() -> str:
    return (ROOT / DOC).read_text()


def test_rules_are_numbered_without_gaps(doc: str) -> None:
    defined = defined_ids(doc)
    for kind, minimum in (("S", 39), ("P", 8)):
        numbers = sorted(int(rule[1:]) for rule in defined if rule[0] == kind)
        assert len(numbers) >= 2 * minimum, f"{kind}: fewer than {minimum} entries"
        top = numbers[-1]
        # Each id twice (its heading and its bold lead), and no id missing below the highest.
        assert numbers == sorted(list(range(1, top + 1)) * 2), f"{kind}1-{kind}{top}: {numbers}"


def test_every_cited_rule_is_defined(doc: str) -> None:
    defined = set(defined_ids(doc))
    cited = citations(ROOT)
    assert {"S1", "S39", "P1", "P8"} <= set(cited)  # the scan sees the citations there are
    missing = {rule: files[:3] for rule, files in cited.items() if rule not in defined}
    assert not missing, f"rule ids cited but not defined in {DOC}: {missing}"


def test_each_rule_gives_a_reason_its_code_and_its_tests(doc: str) -> None:
    entries = re.split(r"^(?=### )", doc, flags=re.MULTILINE)
    rules = {m[1]: entry for entry in entries if (m := re.match(r"### ([SP][0-9]{1,2})\b", entry))}
    assert len(rules) >= 47
    for rule, entry in rules.items():
        for field in ("- Why:", "- Code:", "- Tests:"):
            assert f"\n{field}" in entry, f"{rule} has no '{field}' line"
        assert f"**{rule}**" in entry, f"{rule}: its entry does not open with **{rule}**"


def test_named_code_and_tests_exist(doc: str) -> None:
    pairs = _FILE_NAME.findall(doc)
    assert len(pairs) > 100
    for rel, name in pairs:
        path = _resolve(rel)
        assert path.is_file(), f"{DOC} names {rel}, which does not exist"
        text = path.read_text()
        if rel.startswith("tests/"):
            assert re.search(rf"^(async )?def {name}\(", text, re.MULTILINE), f"no test {rel}::{name}"
        else:
            assert re.search(rf"\b{name}\b", text), f"{rel} has no {name}"
    for rel in _PATH.findall(doc):
        assert _resolve(rel.rstrip("/")).exists(), f"{DOC} names {rel}, which does not exist"


def test_links_within_the_page_resolve(doc: str) -> None:
    anchors = {_slug(line.lstrip("#")) for line in doc.splitlines() if line.startswith("#")}
    broken = sorted(set(_LINK.findall(doc)) - anchors)
    assert not broken, f"links to missing headings: {broken}"


def test_the_scan_reads_comments_strings_and_test_names_only() -> None:
    assert cited_ids("S15-S17, P1-P3 and S9") == {"S15", "S16", "S17", "P1", "P2", "P3", "S9"}
    assert cited_ids("P2P transfers, a P99 latency, p50, S3x") == set()
    cpp = 'int S1 = 0;  // S2\n/* S3 */ auto s = "S4"; char c = \'S\'; int k = 1\'000;'
    assert cited_ids("\n".join(_cpp_text(cpp))) == {"S2", "S3", "S4"}
    py = 'S5 = 1  # S6\ndef test_s7_p8_x():\n    """S9"""\n    return "S10"\n'
    assert cited_ids("\n".join(_python_text(py))) == {"S6", "S7", "P8", "S9", "S10"}


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = outside_pointers(ROOT)
    assert not found, "pointers to files outside the repository:\n" + "\n".join(found)
