"""Every command the documentation shows still works: modes exist, modules import, flags parse.

The shell commands are taken from the fenced blocks of the README, the guidelines and the
other markdown files. Each is checked without running the job: a RUN_MODE must be in
entrypoint.sh's table, a ``python -m`` / ``torchrun -m`` module must import, and its
arguments must parse with that module's own argparse (``main(argv)`` is stopped right
after ``parse_args``); a test file named to pytest must exist. Commands of other tools
(pip, docker-compose, kubectl, sbatch, git) are listed as not checked here.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted({*REPO.glob("*.md"), *REPO.glob("phase*/*.md"), *REPO.glob("solutions/**/*.md"),
               *REPO.glob("docs/**/*.md"), *REPO.glob("grading/**/*.md"), *REPO.glob("deploy/**/*.md")})
STARTS = ("pytest", "python", "./entrypoint.sh", "torchrun", "RUN_MODE=", "IMPL=", "NPROC=", "NNODES=")
OTHER_TOOLS = ("pip", "docker-compose", "docker", "kubectl", "sbatch", "srun", "git", "terraform", "cd", "export",
               "bash", "cat", "ls", "curl", "nvidia-smi", "watch", "tail", "source")


def _commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for each shell command in the fenced blocks of ``path``."""
    found, in_block, lang, pending, start = [], False, "", "", 0
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            in_block, lang = (not in_block), fence.group(1)
            continue
        if not in_block or lang not in ("", "bash", "sh", "shell", "console"):
            continue
        text = line.strip().removeprefix("$ ")
        if pending:
            text, start = pending + " " + text, start
        else:
            start = lineno
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        pending = ""
        text = re.split(r"\s+#\s", " " + text, maxsplit=1)[0].strip()  # trailing comments
        if text.startswith(STARTS) or (lang and text.split(" ")[0] in OTHER_TOOLS):
            found.append((start, text))
    return found


def _modes() -> dict[str, str]:
    return dict(re.findall(r"^\s*\[(\w+)\]=([\w.]+)\s*$", (REPO / "entrypoint.sh").read_text(), flags=re.M))


class _Parsed(Exception):
    pass


def _check_args(module: str, args: list[str]) -> str | None:
    """None if ``module``'s argparse accepts ``args`` (or it takes none), else the reason."""
    mod = importlib.import_module(module)
    main = getattr(mod, "main", None)
    if main is None:
        return None if not args else f"{module} has no main() to take {args}"
    original, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    depth = []  # parse_args calls parse_known_args: only the outermost call stops main()

    def stop_after(parse):
        def wrapper(self, args=None, namespace=None):
            depth.append(1)
            try:
                result = parse(self, args, namespace)
            finally:
                depth.pop()
            if depth:
                return result
            raise _Parsed(result)
        return wrapper

    parse_args, parse_known_args = stop_after(original), stop_after(original_known)

    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = parse_args, parse_known_args
    takes_argv = bool(inspect.signature(main).parameters)  # else main() reads sys.argv itself
    saved_argv = sys.argv
    try:
        if takes_argv:
            main(args)
        else:
            sys.argv = [module, *args]
            main()
    except _Parsed:
        return None
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in args or "-h" in args):
            return None
        return f"{module} rejects {args} (exit {exc.code})"
    finally:
        sys.argv = saved_argv
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = original, original_known
    return f"{module}.main({args}) returned without parsing arguments"


def check(command: str) -> str | None:
    """None if the documented command is consistent with the code, else what is wrong."""
    # Doc notation: "[--tp-size 4]" is optional (checked as given); "a && b" is two commands.
    command = re.sub(r"\[([^\]]*)\]", r"\1", command)
    parts = re.split(r"\s*(?:&&|\|\||;)\s*", command)
    if len(parts) > 1:
        return next((p for p in map(check, parts) if p), None)
    # Doc notation: "[--quick]" is an optional flag (checked as given), "..." elides more arguments.
    words = [w[1:-1] if w.startswith("[") and w.endswith("]") else w for w in shlex.split(command) if w != "..."]
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        return None
    tool, rest = words[0], words[1:]
    if tool == "./entrypoint.sh":
        mode = env.get("RUN_MODE", "tour")
        modes = _modes()
        if mode not in modes:
            return f"RUN_MODE={mode} is not in entrypoint.sh's table"
        if env.get("IMPL", "solutions") not in ("solutions", "templates"):
            return f"IMPL={env['IMPL']} is neither solutions nor templates"
        # entrypoint.sh's own argument (a trace of any mode) never reaches the mode
        rest = [w for i, w in enumerate(rest) if w != "--trace" and not w.startswith("--trace=")
                and (i == 0 or rest[i - 1] != "--trace")]
        return _check_args(modes[mode], rest)
    if tool in ("python", "python3", "torchrun"):
        if "-m" not in rest:
            script = next((w for w in rest if w.endswith(".py")), None)
            return None if script is None or (REPO / script).is_file() else f"{script} does not exist"
        i = rest.index("-m")
        module, args = rest[i + 1], rest[i + 2:]
        if module in ("pytest", "pip", "doctest"):
            return check(" ".join(shlex.quote(w) for w in [module, *args]))
        spec = importlib.util.find_spec(module)
        if spec is None:
            return f"module {module} does not exist"
        if spec.submodule_search_locations is not None:  # a package: `python -m` runs its __main__
            module += ".__main__"
        return _check_args(module, args)
    if tool == "pytest":
        for word in rest:
            path = word.split("::")[0]
            if path.startswith("tests/") and not (REPO / path).exists():
                return f"{path} does not exist"
        return None
    return None  # another tool's command: not checked here


def _all_commands():
    return [pytest.param(path, lineno, cmd, id=f"{path.relative_to(REPO)}:{lineno}")
            for path in DOCS for lineno, cmd in _commands(path)]


def test_the_docs_show_commands():
    assert len(_all_commands()) > 20, "the command extraction found almost nothing: is the fence parsing broken?"


@pytest.mark.parametrize("path, lineno, command", _all_commands())
def test_documented_command_matches_the_code(path, lineno, command):
    problem = check(command)
    assert problem is None, f"{path.relative_to(REPO)}:{lineno}: `{command}`: {problem}"


@pytest.mark.parametrize("command, wrong", [
    ("RUN_MODE=nope ./entrypoint.sh", "not in entrypoint.sh's table"),
    ("RUN_MODE=data_parallel_naive ./entrypoint.sh --no-such-flag", "rejects"),
    ("python -m distlab.nothing_here", "does not exist"),
    ("pytest tests/test_phase9.py", "does not exist"),
])
def test_the_checker_catches_drift(command, wrong):
    assert wrong in (check(command) or "")


def _worker_mismatched_allreduce(rank, world_size):
    import torch
    import torch.distributed as dist

    # The launcher's forkserver imported torch before this test set the variable: read it
    # now, and make a group after it (the DETAIL checks wrap groups when they are made).
    dist.set_debug_level_from_env()
    group = dist.new_group(list(range(world_size)))
    dist.all_reduce(torch.ones(4 + rank), group=group)  # rank 0: 4 elements, rank 1: 5


def test_torch_distributed_debug_detail_catches_the_mismatch_the_guide_shows(monkeypatch):
    """docs/troubleshooting.md quotes this failure: keep the quote true."""
    from distlab.spawn import run_distributed

    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with pytest.raises(RuntimeError) as info:
        run_distributed(_worker_mismatched_allreduce, 2, timeout_s=60, hang_s=0)  # torch reports it, not the doctor
    message = str(info.value)
    assert "Detected mismatch between collectives on ranks" in message, message[:1000]
    assert "TensorShape=[4]" in message and "TensorShape=[5]" in message
    guide = (REPO / "docs" / "troubleshooting.md").read_text()
    assert "Detected mismatch between collectives on ranks. Rank 0 is running collective" in guide


def test_every_bench_module_is_on_the_readmes_map():
    """The README's map of distlab/ names every module (a package by its folder), so a newcomer finds each room."""
    root = Path(__file__).resolve().parents[1]
    section = re.search(r"^## The bench \(`distlab/`\)\n(.*?)^## ", (root / "README.md").read_text(), re.S | re.M)
    assert section, "README.md has no '## The bench (`distlab/`)' section"
    mapped = set(re.findall(r"`((?:[a-z0-9_]+/)?[a-z0-9_]+(?:\.py|/))`", section.group(1)))
    missing = []
    for path in sorted((root / "distlab").rglob("*.py")):
        rel = path.relative_to(root / "distlab")
        if rel.name in ("__init__.py", "__main__.py") and rel.parent == Path("."):
            continue
        if len(rel.parts) > 1 and rel.parts[0] not in ("lessons", "grading"):
            name = f"{rel.parts[0]}/"  # a package of the bench's own (the cockpit): its folder
        else:
            name = rel.as_posix()
        if rel.name == "__init__.py":
            continue
        if name not in mapped:
            missing.append(name)
    assert not missing, f"distlab modules missing from the README's map of the bench: {sorted(set(missing))}"
