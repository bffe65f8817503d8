"""Every command README.md and docs/*.md show is accepted, at ``--help`` cost (seconds).

The commands are those of the pages' fenced shell blocks (and of unlabelled blocks, where a
line starts with a known program or ``$``), and the inline code spans that are a whole
``./dev.sh ...`` or ``python -m ...`` command. A command is read as a shell would
(continuation lines joined, comments dropped, ``VAR=value`` and ``env -u VAR`` prefixes
skipped, a ``for`` loop's body with the loop's first value; ``...`` for left-out options
dropped) and checked without running it:

- ``python -m jobs.train ...`` (also through ``./dev.sh train``, ``.venv/bin/python`` and
  ``ray job submit ... -- python -m jobs.train``): the whole configuration is resolved as the
  job would (``jobs.train.build_config``: ``--config FILE``, the shortcuts and every
  ``--set key=value`` validated against the config classes);
- any other ``python -m MODULE ...`` (``./dev.sh python``, ``./dev.sh bench NAME``): the
  module exists and its ``main`` parses the arguments (stopped right after ``parse_args``);
  named without arguments (``python -m jobs.predict`` in a sentence), the module exists;
- ``pytest`` (``./dev.sh test``, ``python -m pytest``): every test file named exists;
- ``ray job submit``: its ``--working-dir`` and ``--runtime-env`` exist, then the entrypoint.

What cannot be checked this way (it starts or stops Ray, installs, changes the shell) is listed
in :data:`NOT_CHECKED` with the reason; a command in none of these forms fails the test, so a new
kind of command in the docs is either checked or listed. A command shown with its refusal
(``$ command`` and the output under it) is in :data:`REFUSED`, and its shown output is checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import pathlib
import re
import shlex
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import pytest

from jobs.train import build_config
from raytrec.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Fenced blocks in these languages hold commands only; an unlabelled block holds commands
#: (a line starting with a known program or with ``$ ``) and their output.
SHELL = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3", ".venv/bin/python"}

#: Commands, by their first words, that are not checked, and why.
NOT_CHECKED = {
    "ray start": "starts a Ray node, a process that outlives the test",
    "ray stop": "stops every Ray process of this user on the machine",
    "ray get-auth-token": "writes the user's Ray auth token (~/.ray/auth_token)",
    "export": "sets variables of the user's shell",
    "source": "changes the user's shell (activates the venv)",
    "pip download": "downloads wheels from the package registry",
    "pip install": "installs packages",
    "getent": "reads the host's name service",
    # A template: NAME and [options] stand for each benchmark and its own options, and every
    # benchmark command the pages show in full is checked where it is shown.
    "python -m benchmarks.NAME": "a template for every benchmark (docs/benchmarks.md)",
    "./dev.sh bench NAME": "the same template through dev.sh",
    "python -m jobs.<name>": "a template for every job in jobs/",
}
#: Placeholders in shown commands, and what stands in for them here.
PLACEHOLDERS = {"FILE": "examples/configs/local_cpu.yaml"}
#: Commands the docs show being refused, with the error a user sees.
REFUSED = {
    "./dev.sh train --set scaling.gang_sise=2": "raytrec: configuration error: unknown key "
    "'scaling.gang_sise' (did you mean 'scaling.gang_size'?)",
}


@dataclasses.dataclass(frozen=True)
class Shown:
    """One command as a page shows it, and the output shown under it (``$`` blocks)."""

    where: str  # page:line
    text: str
    output: tuple[str, ...] = ()


def _blocks(page: pathlib.Path) -> Iterator[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block of ``page``."""
    lang, start, lines = None, 0, []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, start, lines = fence.group(1), n + 1, []
        elif fence:
            yield lang, start, lines
            lang = None
        elif lang is not None:
            lines.append(line)


def _is_command(line: str) -> bool:
    words = line.split()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return bool(words) and (
        words[0] in {*PYTHONS, "./dev.sh", "ray", ".venv/bin/ray", "pip", "export", "for"}
    )


def shown_commands(page: pathlib.Path) -> Iterator[Shown]:
    """Every command in ``page``'s fenced shell blocks and unlabelled blocks."""
    name = page.relative_to(ROOT)
    for lang, start, lines in _blocks(page):
        if lang not in SHELL and lang != "":
            continue
        i = 0
        while i < len(lines):
            n, line = start + i, lines[i].strip()
            i += 1
            prompt = line.startswith("$ ")
            line = line.removeprefix("$ ")
            if not line or (lang == "" and not prompt and not _is_command(line)):
                continue
            while line.endswith("\\") and i < len(lines):  # a continued line
                line, i = line[:-1] + " " + lines[i].strip(), i + 1
            if line.startswith("for ") and not re.search(r"\bdone\s*$", line):
                while i < len(lines):  # a loop over several lines: one command
                    joint = " " if line.endswith(" do") else "; "
                    line, i = f"{line}{joint}{lines[i].strip()}", i + 1
                    if re.search(r"\bdone\s*$", line):
                        break
            output: list[str] = []
            while prompt and i < len(lines) and not lines[i].startswith("$ "):
                output.append(lines[i].strip())
                i += 1
            yield Shown(f"{name}:{n}", line, tuple(output))


#: An inline code span that is a whole command of the project's own.
INLINE = re.compile(r"`((?:\./dev\.sh|(?:\.venv/bin/)?python -m) [^`]+)`")


def inline_commands(page: pathlib.Path) -> Iterator[Shown]:
    """Every inline code span of ``page`` (outside fenced blocks) that is a whole
    ``./dev.sh ...`` or ``python -m ...`` command."""
    name, fenced = page.relative_to(ROOT), False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if re.match(r"^\s*```", line):
            fenced = not fenced
        elif not fenced:
            yield from (Shown(f"{name}:{n}", m.group(1)) for m in INLINE.finditer(line))


ALL = [c for page in PAGES for c in (*shown_commands(page), *inline_commands(page))]


def _words(text: str) -> list[str]:
    """The command's words as the shell splits them, with a ``for`` loop's body taken at the
    loop's first value, and the environment prefixes dropped."""
    loop = re.match(r"^for (\w+) in (\S+)[^;]*;\s*do\s+(.*?);?\s*done\s*$", text)
    if loop:
        var, first, body = loop.groups()
        text = re.sub(rf"\$\{{?{var}\}}?\b", first, body)
    words = shlex.split(text, comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    if words[:2] == ["env", "-u"]:
        words = words[3:]
    if ">" in words:  # output redirected to a file
        words = words[: words.index(">")]
    # "..." stands for options the sentence leaves out (or, after an option, for its value).
    words = [w for i, w in enumerate(words) if w != "..." or words[i - 1].startswith("--")]
    return [PLACEHOLDERS.get(w, w) for w in words]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse_only(module: str, args: Sequence[str]) -> argparse.Namespace:
    """The namespace ``python -m module args`` parses its arguments into; its ``main`` is stopped
    right after ``parse_args``, before it does anything."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"no module {module}"
    if spec.submodule_search_locations is not None:  # a package runs as its __main__
        module = f"{module}.__main__"
    main = getattr(importlib.import_module(module), "main", None)
    assert main is not None, f"{module} has no main(argv)"
    return _parse_with(main, args, module)


def _parse_with(main: Any, args: Sequence[str], what: str) -> argparse.Namespace:
    parse_args = argparse.ArgumentParser.parse_args

    def stop_after(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        raise _Parsed(parse_args(self, *a, **kw))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop_after):
        try:
            main(list(args))
        except _Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{what}'s main(argv) returned without parsing its arguments")


def check_pytest(args: Sequence[str]) -> None:
    paths = [a.split("::")[0] for a in args if a.startswith("tests/")]
    for path in paths:
        assert (ROOT / path).is_file() or (ROOT / path).is_dir(), f"no test file or folder {path}"


def check_module(module: str, args: Sequence[str]) -> None:
    if module == "pytest":
        check_pytest(args)
    elif module == "jobs.train":
        if "--help" in args or "-h" in args:
            with pytest.raises(SystemExit, match="0"):
                build_config(args)
            return
        build_config(args)  # the whole config, as the job resolves it
    elif args:
        parse_only(module, args)
    else:  # a module named, or run without arguments
        assert importlib.util.find_spec(module) is not None, f"no module {module}"


def check_script(path: str, args: Sequence[str]) -> None:
    """``python path/to/script.py args``: the script exists and its ``main(argv)`` parses them."""
    script = ROOT / path
    assert script.is_file(), f"no script {path}"
    spec = importlib.util.spec_from_file_location(f"_doc_script_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    assert main is not None, f"{path} has no main(argv)"
    _parse_with(main, args, path)


def check(words: list[str]) -> None:
    """Checks one command (module doc), or fails saying it is of no known form."""
    program, rest = words[0], words[1:]
    plain = {**{p: "python" for p in PYTHONS}, ".venv/bin/ray": "ray"}.get(program, program)
    if any(" ".join([plain, *rest][:n]) in NOT_CHECKED for n in (1, 2, 3)):
        return
    if program == "./dev.sh":
        sub, rest = rest[0], rest[1:]
        dev = pathlib.Path(ROOT / "dev.sh").read_text()
        assert re.search(rf"^\s*{sub}\)", dev, re.M), f"dev.sh has no '{sub}' command"
        if sub == "train":
            check_module("jobs.train", rest)
        elif sub == "bench":
            check_module(f"benchmarks.{rest[0]}", rest[1:])
        elif sub == "python":
            check(["python", *rest])
        elif sub == "test":
            check_pytest(rest)
        return
    if program in PYTHONS and rest[:1] == ["-m"]:
        check_module(rest[1], rest[2:])
        return
    if program in PYTHONS and rest and rest[0].endswith(".py"):
        check_script(rest[0], rest[1:])
        return
    if plain == "ray" and rest[:2] == ["job", "submit"]:
        assert "--" in rest, "ray job submit needs '-- <entrypoint>'"
        options, entrypoint = rest[2 : rest.index("--")], rest[rest.index("--") + 1 :]
        for flag in ("--working-dir", "--runtime-env"):
            if flag in options:
                path = ROOT / options[options.index(flag) + 1]
                assert path.exists(), f"{flag} {path} does not exist"
        check(entrypoint)
        return
    raise AssertionError(f"not a command this test knows how to check: {' '.join(words)}")


@pytest.mark.parametrize("shown", ALL, ids=[c.where for c in ALL])
def test_every_command_the_docs_show_is_accepted(
    shown: Shown, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the pages' paths are relative to the repository
    words = _words(shown.text)
    if shown.text in REFUSED:
        with pytest.raises(ConfigError) as refused:
            check(words)
        message = f"raytrec: configuration error: {' '.join(str(refused.value).split())}"
        assert message.startswith(REFUSED[shown.text])
        assert shown.output == (message,), "the page shows another error than the job prints"
        return
    check(words)


def test_the_pages_show_commands_of_every_kind() -> None:
    """The reader above finds what the pages hold (a broken reader would check nothing)."""
    texts = [c.text for c in ALL]
    assert len(texts) >= 30
    assert any(t.startswith("./dev.sh train --config") for t in texts)
    assert any("ray job submit" in t and "-- python -m jobs.train" in t for t in texts)
    assert any(t.startswith("for s in 0 1; do") for t in texts)
    assert all(t in texts for t in REFUSED)


@pytest.mark.parametrize(
    ("words", "error", "match"),
    [
        (["./dev.sh", "train", "--set", "faults.faults=[]"], ConfigError, "'testing.faults'"),
        (["python", "-m", "jobs.train", "--set", "stragglers=null"], ConfigError, "stragglers"),
        (["python", "-m", "jobs.train", "--config", "nowhere.yaml"], ConfigError, "nowhere"),
        (["python", "-m", "jobs.drain", "runs/x", "--no-such-flag"], SystemExit, "2"),
        (["python", "-m", "jobs.no_such_job"], AssertionError, "no module"),
        (["./dev.sh", "test", "tests/test_no_such_file.py"], AssertionError, "no test file"),
        (["./dev.sh", "deploy"], AssertionError, "no 'deploy' command"),
        (
            ["ray", "job", "submit", "--runtime-env", "nowhere.yaml", "--", "python", "-m", "x"],
            AssertionError,
            "does not exist",
        ),
        (["make", "all"], AssertionError, "not a command this test knows"),
    ],
)
def test_a_refused_command_fails_the_check(
    words: list[str], error: type[BaseException], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(error, match=match):
        check(words)
