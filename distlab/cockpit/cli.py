"""The cockpit's commands: status, next, check, hint, watch, reset (``python -m distlab --help``)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, TextIO

from distlab.cockpit import checks, course
from distlab.cockpit import warm as launcher
from distlab.cockpit.course import Exercise

BAR = 20


def _command(ex: Exercise) -> str:
    return f"python -m distlab check {ex.key}"


def status(root: Path, out: TextIO) -> None:
    """Every exercise of every phase: state and points from the last check; a bar per phase."""
    state = course.load_state(root)
    phases: OrderedDict[int, list[Exercise]] = OrderedDict()
    for ex in course.exercises():
        phases.setdefault(ex.phase, []).append(ex)
    for phase, exs in phases.items():
        got = sum(state["checks"].get(ex.name, {}).get("points", 0.0) for ex in exs
                  if not state["checks"].get(ex.name, {}).get("partial"))
        total = sum(ex.weight for ex in exs)
        states = [course.exercise_state(ex, root, state) for ex in exs]
        done = round(BAR * got / total) if total else 0
        print(f"Phase {phase}  [{'#' * done}{'.' * (BAR - done)}]  {got:g}/{total:g} points, "
              f"{sum(s == 'passing' for s in states)} of {len(exs)} exercises passing", file=out)
        for ex, st in zip(exs, states):
            last = state["checks"].get(ex.name)
            tests = f"{last['passed']}/{last['total']} tests" if last else ""
            print(f"  {ex.name:<48} {st:<24} {tests:<12} {last['points'] if last else 0:g}/{ex.weight:g}", file=out)


def first_unfinished(root: Path) -> Exercise | None:
    return course.what_next(root)


def next_(root: Path, out: TextIO) -> Exercise | None:
    """The exercise to work on (course.what_next): its TODO regions (file:line), guideline section, the command."""
    ex = first_unfinished(root)
    if ex is None:
        print("every exercise passes: nothing left to do", file=out)
        return None
    print(f"next: {ex.name} ({ex.weight:g} points, "
          f"{course.exercise_state(ex, root, course.load_state(root))})", file=out)
    for r in course.regions_of(ex, root):
        # the manifest's section: a region holding the learner's code has no `raise todo` left to read it from
        print(f"  TODO {r.id} {r.title}: {r.path.as_posix()}:{r.line}   (read {ex.guide})", file=out)
    print(f"  read it:   python -m distlab guide {ex.key}", file=out)
    print(f"  check it:  {_command(ex)}", file=out)
    print(f"  a hint:    python -m distlab hint {ex.key}", file=out)
    return ex


def check(ident: str, root: Path, out: TextIO, trace_dir: Path | None = None, warm: bool = False) -> dict:
    """Check the exercise ``ident`` names; a range that is no exercise ("3.1-3.3") checks each one inside it."""
    chosen = course.select(ident)
    results = [_check_one(ex, root, out, trace_dir, warm) for ex in chosen]
    if len(results) == 1:
        return results[0]
    every = [t for r in results for t in r["tests"]]
    return {"passed": sum(r["passed"] for r in results), "total": sum(r["total"] for r in results),
            "points": sum(r["points"] for r in results), "weight": sum(r["weight"] for r in results),
            "partial": any(r["partial"] for r in results),
            "tests": every, "exercises": [ex.name for ex in chosen]}


def _check_one(ex: Exercise, root: Path, out: TextIO, trace_dir: Path | None, warm: bool) -> dict:
    print(f"checking {ex.name} on your templates ...", file=out, flush=True)
    result = checks.run_check(ex, root, trace_dir, warm=warm)
    for line in checks.verdict_lines(ex, result):
        print(line, file=out)
    if trace_dir is not None:
        from distlab.trace import merge

        merged = merge(trace_dir)
        print(f"trace: {merged} (open it in https://ui.perfetto.dev)" if merged else
              f"trace: no rank wrote one under {trace_dir}", file=out)
    return result


def guide(ident: str, root: Path, out: TextIO) -> str:
    """The exercise's guideline section, its hints left out (``hint`` gives them one at a time)."""
    from distlab.cockpit.hints import section

    ex = course.find(ident)
    text = section(ex, root)
    print(text, file=out)
    return text


def hint(ident: str, root: Path, out: TextIO, again: bool = False) -> str | None:
    """The next hint of the exercise the learner has not seen (remembered in the state file)."""
    from distlab.cockpit.hints import hints

    ex = course.find(ident)
    all_ = hints(ex, root)
    state = course.load_state(root)
    seen = 0 if again else state["hints"].get(ex.name, 0)
    if not all_:
        print(f"{ex.name} has no hints in its guidelines", file=out)
        return None
    if seen >= len(all_):
        print(f"you have seen all {len(all_)} hints of {ex.name}; `python -m distlab hint {ex.key} --again` "
              "starts over", file=out)
        return None
    todo_id, text = all_[seen]
    print(f"hint {seen + 1} of {len(all_)} for {ex.name} (TODO {todo_id}):\n{text}", file=out)
    state["hints"][ex.name] = seen + 1
    course.save_state(root, state)
    return text


def reset(ident: str, root: Path, out: TextIO) -> list[Path]:
    """A TODO id resets that region; an exercise's key ("1.1-1.3") resets all of its regions."""
    from distlab.cockpit.reset import reset as reset_region

    ex = course.find(ident)
    regions = course.regions_of(ex, root)
    if ident.strip() in (ex.key, ex.name):
        chosen = regions
    else:
        chosen = [r for r in regions if r.id == ident] or [r for r in regions if r.base == ident]
    if not chosen:
        if regions:
            raise ValueError(f"no TODO {ident} in {ex.name}: its TODOs are {', '.join(r.id for r in regions)}")
        raise ValueError(f"the '# --- TODO' lines of {ex.name} are gone from your templates, so there is no region "
                         "to reset: `python -m distlab.templates --write --force FILE` regenerates a whole template "
                         "(your code in it is lost)")
    kept = []
    for r in chosen:
        kept.append(reset_region(r, root))
        print(f"TODO {r.id} in {r.path.as_posix()} is its stub again; your code was kept in "
              f"{kept[-1].relative_to(root).as_posix()}", file=out)
    state = course.load_state(root)
    state["checks"].pop(ex.name, None)  # its last verdict was about code that is gone
    course.save_state(root, state)
    return kept


def restore(ident: str, root: Path, out: TextIO) -> list[Path]:
    """Undo ``reset``: each chosen region (as ``reset`` chooses) gets the code it last kept back."""
    from distlab.cockpit.reset import kept_versions, restore as restore_region

    ex = course.find(ident)
    regions = course.regions_of(ex, root)
    chosen = regions if ident.strip() in (ex.key, ex.name) else \
        [r for r in regions if r.id == ident] or [r for r in regions if r.base == ident]
    chosen = [r for r in chosen if kept_versions(r, root)] or chosen[:1]
    if not chosen:
        raise ValueError(f"no TODO {ident} in your templates: `python -m distlab status` lists the exercises")
    done = []
    for r in chosen:
        back, replaced = restore_region(r, root)
        done.append(back)
        print(f"TODO {r.id} in {r.path.as_posix()} holds your code from {back.name} again; what it held was kept in "
              f"{replaced.relative_to(root).as_posix()}", file=out)
    state = course.load_state(root)
    state["checks"].pop(ex.name, None)  # its last verdict was about the code that was there
    course.save_state(root, state)
    return done


def dev_check(repo: Path, out: TextIO) -> int:
    """``python -m distlab dev check``: the manifest against the tree, one line per problem."""
    from distlab.manifest import MANIFEST, check as check_manifest, exercises

    problems = check_manifest(repo)
    for line in problems:
        print(line, file=out)
    print(f"{MANIFEST.relative_to(repo) if MANIFEST.is_relative_to(repo) else MANIFEST}: "
          + (f"{len(problems)} problem(s)" if problems else f"{len(exercises())} exercises, no problem"), file=out)
    return 1 if problems else 0


def watch(root: Path, out: TextIO, ident: str | None = None, interval_s: float = 0.5, max_checks: int | None = None,
          clear: bool = True, on_check: Callable[[dict], None] | None = None, warm: bool = True) -> int:
    """Check an exercise now and whenever its TODO regions change; ``ident`` names it (the watch stays on it),
    or None: the current exercise (course.what_next), and the next one once it passes.

    Polls the exercise's regions (course.fingerprint) every ``interval_s`` (no file-watch dependency). Returns the number of checks run; stops after ``max_checks`` (tests) or Ctrl-C.
    In the learner's own checkout the checks run in the warm launcher (``warm``), which ends with the watch.
    """
    ex = course.find(ident) if ident else first_unfinished(root)
    runs, seen = 0, None
    try:
        while ex is not None and (max_checks is None or runs < max_checks):
            now = course.fingerprint(ex, root)
            if now == seen:
                time.sleep(interval_s)  # polling: the next look at the regions
                continue
            seen = now
            if clear and out.isatty():
                out.write("\033[2J\033[H")  # one screen: the latest verdict only
            result = _check_one(ex, root, out, None, warm)
            runs += 1
            if on_check:
                on_check(result)
            files = ", ".join(dict.fromkeys(p for p, _, _ in seen))
            if checks.passed(result) and ident is None:  # watching "the current exercise": on to the next one
                ex = first_unfinished(root)
                print(f"\n{ex.name if ex else 'nothing'} is next" + (f": {_command(ex)}" if ex else ""), file=out)
                seen = None
            elif checks.passed(result):  # the learner named this exercise: stay on it
                print(f"\n{ex.name} passes; still watching {files} (Ctrl-C stops; "
                      "`python -m distlab next` says what is next)", file=out)
            else:
                print(f"\nwatching {files}: save to check again (Ctrl-C stops)", file=out)
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        if warm and root.resolve() == course.REPO.resolve():
            from distlab.cockpit import warm as launcher

            launcher.stop(root)
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distlab", description="The learner's cockpit.")
    parser.add_argument("--root", type=Path, default=None,
                        help="your checkout (default: the one around the current folder)")
    # --root also after the command (`check 1.1 --root DIR`); SUPPRESS keeps the main parser's value
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", parents=[common], help="every exercise, its state and points; a progress bar per phase")
    sub.add_parser("next", parents=[common], help="what to work on (the smallest exercise of the first unfinished TODO): "
                                                   "TODO file:line, guideline, command")
    p = sub.add_parser("check", parents=[common], help="run exactly that exercise's tests on your templates")
    p.add_argument("id", help="an exercise (1.1-1.3), one of its TODO ids (1.2), or a range of exercises (3.1-3.3)")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="write a Perfetto/Chrome trace of every world the tests start to DIR/trace.json")
    p.add_argument("--warm", action="store_true",
                   help="keep torch, pytest and the ranks' launcher loaded between checks (a server in .distlab/; "
                        "`python -m distlab warm --stop` ends it, 10 idle minutes too)")
    p = sub.add_parser("warm", parents=[common], help="the warm launcher of check --warm")
    p.add_argument("--stop", action="store_true", help="end it")
    p = sub.add_parser("hint", parents=[common], help="the next hint you have not seen")
    p.add_argument("id")
    p.add_argument("--again", action="store_true", help="start from the first hint")
    p = sub.add_parser("watch", parents=[common], help="re-check an exercise whenever you change its TODO regions")
    p.add_argument("id", nargs="?", default=None, help="stay on this exercise (default: what `next` says, "
                   "and the next one once it passes)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between looks at the file")
    p.add_argument("--max-checks", type=int, default=None, help="stop after this many checks")
    p.add_argument("--cold", action="store_true", help="a new pytest for every check, not the warm launcher")
    p = sub.add_parser("reset", parents=[common], help="put a TODO region (1.2) or all of an exercise's (1.1-1.3) back to its stub")
    p.add_argument("id")
    p = sub.add_parser("restore", parents=[common], help="undo a reset: the code it kept goes back in the region")
    p.add_argument("id")
    p = sub.add_parser("guide", parents=[common], help="the exercise's guideline section, without its hints")
    p.add_argument("id")
    p = sub.add_parser("dev", parents=[common], help="for contributors: `dev check` checks distlab/course.toml "
                                                     "against the tree (CONTRIBUTING.md)")
    p.add_argument("what", choices=["check"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = (args.root or course.learner_root()).resolve()
    out = sys.stdout
    try:
        if args.command == "status":
            status(root, out)
        elif args.command == "next":
            next_(root, out)
        elif args.command == "check":
            return 0 if checks.passed(check(args.id, root, out, args.trace, args.warm)) else 1
        elif args.command == "warm":
            from distlab.cockpit import warm

            if args.stop:
                print("the warm launcher " + ("stopped" if warm.stop(root) else "was not running"), file=out)
            else:
                print(f"the warm launcher listens on {warm.ensure_server(root, course.REPO)}", file=out)
        elif args.command == "hint":
            hint(args.id, root, out, args.again)
        elif args.command == "watch":
            watch(root, out, args.id, args.interval, args.max_checks, warm=not args.cold)
        elif args.command == "reset":
            reset(args.id, root, out)
        elif args.command == "restore":
            restore(args.id, root, out)
        elif args.command == "guide":
            guide(args.id, root, out)
        elif args.command == "dev":
            return dev_check(course.REPO, out)
    except (ValueError, TimeoutError, launcher.NotStarted) as exc:  # one line: what to change
        print(f"distlab {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m distlab status | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:
        # Ctrl-C: one line, not the traceback of whatever this process was waiting in. The check's pytest
        # (same terminal) got the SIGINT too and is ended with it, and its ranks with pytest (TIE_ENV).
        print(f"distlab {args.command}: stopped (Ctrl-C)"
              + (": nothing was recorded for this check" if args.command == "check" else ""), file=sys.stderr)
        return 130
    return 0
