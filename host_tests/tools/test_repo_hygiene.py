"""Everything a reader needs is in the repository.

- no tracked file refers to a directory beside the checkout (the inputs
  folder next to it) or
  to an absolute path of some machine (a home directory, a work tree, /tmp
  used as where the project lives);
- every `*.md` a tracked file names exists in the repository;
- docs/retained.md covers each retained-message rule with tests that exist,
  and every test named after a rule is listed under it.
"""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SELF = "host_tests/tools/test_repo_hygiene.py"

# Built from pieces so that this file does not match itself.
SIBLING = ".." + "/shared"
MACHINE_PATHS = [
    "/" + "work/",
    "/" + "home/",
    "/" + "root/",
    "/" + "Users/",
    "C:" + "\\Users",
    "/" + "tmp/",
]
#: (file, text on the line) where an absolute path is not a reference to a
#: place on some machine but what the code does.
ALLOWED = [
    # MicroPython's unix port has no tempfile module: the store unit tests
    # make their scratch files there
    ("host_tests/portable/unit_store.py", '"/' + 'tmp/edgestore-'),
    ("host_tests/portable/unit_engine.py", '"/' + 'tmp/engine-'),
]
#: `*.md` names that are not references to a document.
NOT_DOC_REFERENCES = [
    ("host_tests/tools/test_boards.py", "ref.md"),  # a scratch file under tmp_path
]
RULES = ["S%d" % i for i in range(1, 9)] + ["D%d" % i for i in range(1, 10)] + \
    ["E%d" % i for i in range(1, 5)] + ["L%d" % i for i in range(1, 6)]


def tracked_files():
    """(relative path, text) of each tracked text file."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for name in out.stdout.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file() or path.is_symlink() or name == SELF:
            continue  # this file names the patterns it looks for
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (golden store files)
        yield name, data.decode("utf-8", "replace")


def hits(pattern_test):
    found = []
    for name, text in tracked_files():
        for n, line in enumerate(text.splitlines(), 1):
            what = pattern_test(name, line)
            if what:
                found.append("%s:%d: %s: %s" % (name, n, what, line.strip()[:120]))
    return found


def test_no_reference_to_a_directory_beside_the_checkout():
    found = hits(lambda name, line: SIBLING in line and SIBLING)
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_no_absolute_machine_paths():
    def bad(name, line):
        for p in MACHINE_PATHS:
            if p in line and not any(f == name and ok in line for f, ok in ALLOWED):
                return p
        return None

    found = hits(bad)
    assert not found, "absolute machine paths:\n" + "\n".join(found)


def test_every_named_document_exists():
    """A file that says `see design.md` must find it: at that path from the
    repository root, beside the file, or in docs/."""
    pattern = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]+\.md\b")

    def missing(name, line):
        for ref in pattern.findall(line):
            if "://" in line and ("//" + ref) in line:
                continue
            if (name, ref) in NOT_DOC_REFERENCES:
                continue
            here = (REPO / name).parent
            if not any((base / ref).is_file() for base in (REPO, here, REPO / "docs")):
                return ref
        return None

    found = hits(missing)
    assert not found, "documents named but not in the repository:\n" + "\n".join(found)


def test_retained_rules_page_lists_existing_tests_for_every_rule():
    page = (REPO / "docs" / "retained.md").read_text()
    sections = re.split(r"^### ", page, flags=re.M)
    by_rule = {}
    for sec in sections[1:]:
        rule = sec.split(":", 1)[0].strip()
        by_rule[rule] = re.findall(r"`(host_tests/[\w/]+\.py)::(test_\w+)`", sec)
    assert sorted(by_rule) == sorted(RULES), sorted(by_rule)
    cited = re.findall(r"`(host_tests/[\w/]+\.py)::(test_\w+)`", page)
    for path, test in cited:
        src = (REPO / path).read_text()
        assert re.search(r"^def %s\(" % test, src, re.M), "%s::%s is gone" % (path, test)
    for rule, tests in by_rule.items():
        assert tests, "no test listed for %s" % rule
    # every test named after a rule is listed under that rule
    for name, text in tracked_files():
        if not (name.startswith("host_tests/") and name.endswith(".py")):
            continue
        for test in re.findall(r"^def (test_\w+)\(", text, re.M):
            for rule in re.findall(r"_([SDEL][1-9])(?=_|$)", test):
                assert (name, test) in by_rule[rule], (
                    "%s::%s is named for %s but docs/retained.md does not list it there"
                    % (name, test, rule))
