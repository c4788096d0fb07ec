"""Every program the suite runs is installed by `make prereqs` or is part of the base system.

`make test` installs the system packages of scripts/prereqs.txt before the first test, so the
order of test files cannot hide a missing install step. This test keeps that list true: it
collects the programs the tests, their scripts and the make targets call and fails, naming the
program and where it is called, when one is neither in the list (a package's command, the base
system, an optional tool) nor installed by the project's own files (the venvs, the repo).

What counts as a call: ``shutil.which("x")`` and ``subprocess.*(["x", ...])`` in Python; the
first word of each simple command in shell scripts and in the recipes ``make -n`` prints (with
``$(shell ...)`` bodies of the makefiles); commands run inside containers (``host.sh(...)``,
``docker exec``) belong to those images and are not the host's.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREREQS = ROOT / "scripts" / "prereqs.txt"
# Python sources and shell scripts whose programs run on the test machine itself.
PYTHON_DIRS = ("tests", "scripts")
SHELL_FILES = (".ci/run",)  # and every *.sh under PYTHON_DIRS
# Make targets the README, .ci/run and the tests call (variables keep them printable with -n).
MAKE_TARGETS = ("test", "test-unit", "test-server", "test-image", "test-ansible", "lint",
                "prereqs", "venv", "image", "image-save", "smoke", "verify",
                "ansible-venv", "ansible-lint",
                "regenerate-extract SERVER=http://x DATASET=d OUT=o")
SUBPROCESS_CALLS = frozenset({"run", "Popen", "call", "check_call", "check_output"})
# Shell words that are no program: keywords keep the next word a command, builtins do not.
KEYWORDS = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "esac",
                      "{", "}", "!", "time"})
BUILTINS = frozenset({
    "for", "case", "in", "function", "return", "exit", "set", "export", "local", "read", "cd",
    "test", "[", "[[", "echo", "printf", ":", ".", "source", "eval", "shift", "trap", "wait",
    "unset", "declare", "readonly", "command", "true", "false", "break", "continue", "shopt",
    "pwd", "type", "umask", "let"})
# Programs that run the word after them (their options skipped); they are programs too.
WRAPPERS = frozenset({"env", "sudo", "timeout", "nohup", "setsid", "exec", "xargs"})
PUNCTUATION = ";&|()<>"


@dataclass(frozen=True)
class Call:
    program: str
    where: str


@dataclass(frozen=True)
class Prereqs:
    """scripts/prereqs.txt: package -> commands, and the base and optional programs."""

    packages: dict[str, list[str]]
    base: frozenset[str]
    optional: frozenset[str]
    venv: dict[str, tuple[str, str]]

    @classmethod
    def read(cls, path: Path = PREREQS) -> Prereqs:
        sections: dict[str, list[str]] = {}
        current = None
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if m := re.fullmatch(r"\[(\w+)\]", line):
                current = sections.setdefault(m[1], [])
            else:
                assert current is not None, f"{path}: {raw!r} before any [section]"
                current.append(line)
        packages = {}
        for line in sections["packages"]:
            pkg, *provides = line.split()
            assert provides, f"{path}: package {pkg} names nothing the suite runs from it"
            packages[pkg] = provides
        venv = {}
        for line in sections["venv"]:
            program, requirement, file = line.split()
            venv[program] = (requirement, file)
        return cls(packages, frozenset(w for line in sections["base"] for w in line.split()),
                   frozenset(w for line in sections["optional"] for w in line.split()), venv)

    def known(self) -> frozenset[str]:
        installed = {w for words in self.packages.values() for w in words if ":" not in w}
        return frozenset(installed | self.base | self.optional | set(self.venv))


def python_calls(path: Path) -> Iterator[Call]:
    """Programs a Python file runs: ``shutil.which("x")`` and ``subprocess.*(["x", ...])``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        first = node.args[0] if node.args else None
        if owner == "shutil" and node.func.attr == "which":
            program = _literal(first)
        elif (owner == "subprocess" and node.func.attr in SUBPROCESS_CALLS
              and isinstance(first, ast.List | ast.Tuple) and first.elts):
            program = _literal(first.elts[0])
        else:
            continue
        if program:
            yield Call(program, f"{rel}:{node.lineno}")


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _logical_lines(text: str) -> Iterator[str]:
    """Lines with backslash continuations joined, comments dropped."""
    for line in re.sub(r"\\\n", " ", text).splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            yield stripped


def shell_programs(command: str, functions: frozenset[str] = frozenset()) -> Iterator[str]:
    """The first word of each simple command of a shell line (after assignments, wrappers),
    leaving out the script's own ``functions``."""
    command = re.sub(r"\$\{[^}]*\}", "$V", command)  # ${...} may hold spaces: one word
    lexer = shlex.shlex(command, posix=True, punctuation_chars=PUNCTUATION)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote across lines: fall back to plain words
        tokens = command.split()
    command_next, target_next = True, False
    for i, tok in enumerate(tokens):
        if tok and set(tok) <= set(PUNCTUATION):
            if "(" in tok or not set(tok) & set("<>"):
                command_next, target_next = True, False  # ; && || | ( <( start a command
            else:
                target_next = True  # a redirection: its target is a file
            continue
        if target_next:
            target_next = False
            continue
        if not command_next or tokens[i + 1:i + 2] == [")"]:
            continue  # an argument, or a case pattern
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\+?=.*", tok) or tok in KEYWORDS:
            continue  # an assignment before the command, or a keyword
        if tok in BUILTINS or tok in functions:
            command_next = False
            continue
        if tok.startswith("-"):
            continue  # a wrapper's option
        command_next = tok in WRAPPERS
        yield tok


def shell_calls(text: str, where: str) -> Iterator[Call]:
    functions = frozenset(re.findall(r"^\s*([A-Za-z_][\w-]*)\s*\(\)", text, re.M))
    for line in _logical_lines(text):
        # Command substitutions run programs too: scan their bodies as commands of their own.
        for body in [line, *re.findall(r"\$\(([^()]*)\)", line)]:
            for program in shell_programs(body, functions):
                yield Call(program, where)


def make_calls() -> Iterator[Call]:
    """Programs in the recipes ``make -n -B`` prints, and in the makefiles' ``$(shell ...)``."""
    for target in MAKE_TARGETS:
        r = subprocess.run(["make", "-n", "-B", "--no-print-directory", *target.split()],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"make -n {target}: {r.stderr[-2000:]}"
        yield from shell_calls(r.stdout, f"make {target.split()[0]}")
    for mk in [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))]:
        for m in re.finditer(r"\$\(shell ((?:[^()]|\([^()]*\))*)\)", mk.read_text()):
            body = m[1].replace("$(ENGINE)", "docker").replace("$$", "$")
            body = re.sub(r"\$\((\w+)\)", r"$\1", body)  # other make variables: words
            yield from shell_calls(body, str(mk.relative_to(ROOT)))


def suite_calls() -> list[Call]:
    calls: list[Call] = []
    for d in PYTHON_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            calls += python_calls(path)
    scripts = [ROOT / rel for rel in SHELL_FILES]
    scripts += [p for d in PYTHON_DIRS for p in sorted((ROOT / d).rglob("*.sh"))]
    for path in scripts:
        calls += shell_calls(path.read_text(), str(path.relative_to(ROOT)))
    calls += make_calls()
    return calls


def from_project(program: str) -> bool:
    """A path into the repo or its venvs (installed by the project's own files), or a
    variable the shell expands (what it names is checked where it is set)."""
    if program.startswith(("$", "`")):
        return True
    if "/" not in program:
        return False
    return Path(os.path.normpath(ROOT / program)).is_relative_to(ROOT)


def unknown(calls: Iterable[Call], prereqs: Prereqs) -> list[Call]:
    known = prereqs.known()
    return [c for c in calls if c.program not in known and not from_project(c.program)]


def test_every_program_the_suite_runs_is_installed_by_make_prereqs():
    prereqs = Prereqs.read()
    calls = suite_calls()
    assert len({c.program for c in calls}) > 20, "the scan found too few programs to be right"
    missing = unknown(calls, prereqs)
    assert not missing, (
        "programs the suite runs that scripts/prereqs.txt does not install (add the Debian "
        "package that provides each to its [packages] table):\n" + "\n".join(
            f"  {c.program} ({c.where})" for c in missing))
    for program, (requirement, file) in prereqs.venv.items():
        assert re.search(rf"^{re.escape(requirement)}\b", (ROOT / file).read_text(), re.M), \
            f"{program}: {file} does not install {requirement}"
    # The install step and the prerequisites it needs are named where a user looks for them.
    readme = (ROOT / "README.md").read_text()
    assert "make prereqs" in readme and "scripts/prereqs.txt" in readme
    assert re.search(r"^test: prereqs ", (ROOT / "Makefile").read_text(), re.M), \
        "make test must install the prerequisites before anything else"


@pytest.mark.parametrize(("snippet", "kind"), [
    ('import subprocess\nsubprocess.run(["skopeo", "copy", "a", "b"])\n', "py"),
    ('import shutil\nshutil.which("buildah")\n', "py"),
    ("set -e\nfoo=$(jq -r .x f.json)\nsudo -E qemu-img convert a b | tee log\n", "sh"),
])
def test_a_program_nobody_installs_is_named(tmp_path, snippet, kind):
    """The check fails, naming the program, when a test starts using one nobody installs."""
    if kind == "py":
        path = ROOT / "tests" / f"_probe_{tmp_path.name}.py"
        path.write_text(snippet)
        try:
            calls = list(python_calls(path))
        finally:
            path.unlink()
    else:
        calls = list(shell_calls(snippet, "probe.sh"))
    missing = {c.program for c in unknown(calls, Prereqs.read())}
    assert missing == {"py": {"skopeo"} if "skopeo" in snippet else {"buildah"},
                       "sh": {"jq", "qemu-img"}}[kind]


def test_the_install_step_is_idempotent_and_names_what_is_missing():
    """`scripts/prereqs.sh --check` (what `make prereqs` runs first) finds nothing missing
    after `make test`'s install, so a second install step touches nothing."""
    r = subprocess.run(["bash", "scripts/prereqs.sh", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every system package" in r.stdout


def test_make_test_checks_free_disk_before_installing():
    """`make test` runs the disk check before the venv: too little room fails at once, naming
    the file system and what to free, instead of pip's ENOSPC minutes later."""
    order = subprocess.run(["make", "-n", "-B", "--no-print-directory", "test"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert order.index("check_disk.py") < order.index("-m venv")
    run = partial(subprocess.run, [sys.executable, "scripts/check_disk.py"], cwd=ROOT,
                  capture_output=True, text=True, timeout=60)
    short = run(env={**os.environ, "HSDUMP_MIN_FREE_GIB": str(1 << 20)})
    assert short.returncode == 1 and "GiB free on the file system of" in short.stderr
    assert "docker system prune" in short.stderr
    assert run(env={**os.environ, "HSDUMP_MIN_FREE_GIB": "0"}).returncode == 0


def test_uv_installs_from_where_pips_configuration_points(tmp_path):
    """`make venv` installs the requirements with uv, which reads no pip.conf: scripts/uv_args.py
    passes pip's own settings (as `pip config list` reports them: files, then PIP_* variables,
    the later winning) to uv, and asks for pip's pick of the best version across indexes."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                    "extra-index-url =\n    file:///srv/a/simple\n    file:///srv/b/simple\n"
                    "constraint = /etc/c.txt\ncert = /etc/ca.crt\n"
                    "[install]\ntrusted-host = mirror.example\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS="/srv/wheels /srv/more",
               PIP_NO_INDEX="1")
    r = subprocess.run([sys.executable, "scripts/uv_args.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60, check=True)
    args = r.stdout.split("\n")[:-1]
    pairs = list(zip(args[:-2:2], args[1:-2:2], strict=True))
    assert pairs == [("--index-strategy", "unsafe-best-match"),
                     ("--index-url", "https://mirror.example/simple"),
                     ("--extra-index-url", "file:///srv/a/simple"),
                     ("--extra-index-url", "file:///srv/b/simple"),
                     ("--find-links", "/srv/wheels"), ("--find-links", "/srv/more"),
                     ("--constraint", "/etc/c.txt"),
                     ("--allow-insecure-host", "mirror.example")]
    assert args[-2:] == ["--no-index", "--native-tls"]
    makefile = (ROOT / "Makefile").read_text()
    assert "$$($(PY) scripts/uv_args.py)" in makefile
