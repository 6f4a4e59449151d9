"""A standby training worker: torch and the job's code imported ahead of time, waiting for its rank.

    python -m ftd.training.warm_worker --entry MODULE[:FUNCTION] [--preload MODULE]... [--wait-s S] [-- ARGS...]

The expensive part of starting a PyTorch worker is not the process but ``import torch`` (1.5 to 3 s of
CPU, more on a loaded node), and then what torch imports lazily on first use (``torch._dynamo``, which
DistributedDataParallel's constructor pulls in, is 3 s more). A standby pays it before it is needed: it
imports torch, :data:`DEFAULT_PRELOAD`, any ``--preload`` module and the entry module, reports ready,
then blocks until its launcher (:mod:`ftd.agent.warm_pool`) hands it an assignment for a round: the
environment a worker of that round needs (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``,
...) and optionally its arguments. It sets them and calls the entry, exiting with its return code: to
the job's code it is a worker started by torchrun.

**Protocol** (one JSON object per line). The process is started with ``stdin`` and ``stdout`` as pipes
to its launcher and ``stderr`` to the log; at once it keeps private duplicates of those two pipes and
points fd 0 at ``/dev/null`` and fd 1 at the log, so the job's code sees an ordinary process.

* worker -> launcher: ``{"event": "ready", "pid", "import_s", "startup_s", "entry", "protocol",
  "prepared", "prepare_s"}`` once everything is imported and the job's ``prepare`` ran (``startup_s``:
  since the process started, including the torch import of the ``ftd.training`` package itself;
  ``import_s``: the entry's own imports after that; ``prepare_s``: its ``prepare``, ``null`` without
  one; ``prepared``: whether a prepared context is held); ``{"event": "prepare_failed", "pid",
  "message"}`` before that when ``prepare`` raised;
  ``{"event": "running", "pid", "t"}`` when the entry is called (``t``: wall-clock seconds);
  ``{"event": "error", "message"}`` before exiting 2 when the entry cannot be imported.
* launcher -> worker: ``{"env": {NAME: VALUE, ...}, "argv": [...] | null}``: the assignment. ``argv``
  ``null`` (or absent) keeps the ``ARGS`` given at start.
* End of file on its ``stdin`` before an assignment: the launcher went away, the standby exits 0.
  After the assignment: the worker SIGKILLs itself, as a worker of a dead node must not go on.

Entries: ``MODULE:FUNCTION`` calls ``FUNCTION(argv)`` (``FUNCTION()`` when it takes no argument, with
``sys.argv`` set either way); ``MODULE`` calls its ``main`` the same way, or, without one, runs the
module as ``__main__`` as ``python -m MODULE`` would; ``path/to/script.py`` runs the script as
``__main__`` (its own imports are then paid at activation, torch's are not). A return value that is an
int is the exit code; ``None`` is 0; ``SystemExit`` is honoured; an exception is printed and exits 1.
A script's directory comes first on ``sys.path``, as ``python script.py`` puts it.

**The prepare hook** (:class:`JobEntry`): a job whose module (or script) defines both ``prepare`` and a
``main`` that takes two arguments opts in. The standby calls ``prepare(argv)`` (``prepare()`` when it
takes none) before it reports ready, with the arguments it was started with, and the activated worker
then calls ``main(argv, prepared)`` with what it returned: the model built, data and compiled code
ready, so that after the assignment only the process group, the sharding and the restore remain. While
``prepare`` runs, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the agent's ``FTD_*`` are set but no
``RANK``, ``WORLD_SIZE``, ``MASTER_*`` or ``FTD_EPOCH``: it must not create the process group or the
Checkpointer. A script is imported (as module ``__ftd_job__``, so its ``__main__`` block does not
run) only when its source defines both functions at top level, which an :mod:`ast` parse checks first;
any other script runs as ``__main__`` at activation, as before. ``main`` gets ``None`` as
``prepared`` when ``prepare`` raised (the standby writes the traceback to its log, sends ``{"event":
"prepare_failed", "message"}`` and reports ready all the same: the job then builds everything after
its assignment, a cold start of the job's own setup with torch still imported) and when the assignment
carries other arguments than the ones ``prepare`` saw; a ``main(argv, prepared=None)`` that calls
``prepare`` itself then runs the same under torchrun or by hand.

With ``FTD_WARM_BACKGROUND=1`` (a refill started while training runs) the imports run under
``SCHED_IDLE`` so that they take only CPU time nobody else wants (the pool sets the policy right after
the spawn, before ``ftd.training``'s own ``import torch``); the standby returns every thread to the
normal policy before it reports ready (its launcher also boosts it when it activates it early). Every
wait is bounded: a standby that gets no assignment within ``--wait-s`` exits 0 and is replaced.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import runpy
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

PROTOCOL = 1
# Imported by every standby before the entry: what a DDP worker otherwise imports lazily on its first
# round. torch._dynamo is the big one (~800 modules, 3 s of CPU): DistributedDataParallel's constructor
# imports it. A module missing from this torch build is skipped; more come with --preload.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
ENV_BACKGROUND = "FTD_WARM_BACKGROUND"
MAX_LINE = 1 << 20  # an assignment larger than this is refused (a runaway launcher, not a job)
EXIT_IMPORT = 2  # the entry could not be imported
EXIT_PROTOCOL = 3  # a malformed assignment, or the standby could not leave SCHED_IDLE
SCRIPT_MODULE = "__ftd_job__"  # the module name of a script imported ahead for its prepare()


class ProtocolError(ValueError):
    pass


# ---- pure parts ---------------------------------------------------------------------------------------


def parse_entry(entry: str) -> tuple[str, str, str | None]:
    """``("path", script, None)`` or ``("module", module, function | None)``."""
    if not entry:
        raise ValueError("--entry is empty")
    if entry.endswith(".py") or os.sep in entry:
        return "path", entry, None
    module, colon, function = entry.partition(":")
    if not module or (colon and not function):
        raise ValueError(f"--entry {entry!r} is not MODULE[:FUNCTION] or a script path")
    return "module", module, function or None


def parse_assignment(line: bytes) -> tuple[dict[str, str], list[str] | None]:
    """The launcher's line -> (env, argv or None); :class:`ProtocolError` when it is malformed."""
    try:
        data = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"assignment is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError("assignment is not a JSON object")
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ProtocolError("assignment env must map strings to strings")
    if any(not k or "=" in k or "\0" in k or "\0" in v for k, v in env.items()):
        raise ProtocolError("assignment env has an invalid name or value")
    argv = data.get("argv")
    if argv is not None and (not isinstance(argv, list) or not all(isinstance(a, str) for a in argv)):
        raise ProtocolError("assignment argv must be a list of strings or null")
    return dict(env), argv


def exit_code(result: object) -> int:
    """What an entry's return value (or ``SystemExit.code``) means as an exit status."""
    if result is None:
        return 0
    if isinstance(result, bool):
        return int(result)
    if isinstance(result, int):
        return result & 0xFF
    return 0  # any other return value: the entry returned normally


def takes_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with one positional argument (``main(argv)``)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume the documented main(argv)
        return True
    return True


def process_age_s() -> float | None:
    """Seconds since this process started (from /proc), imports of the package included; ``None``
    where /proc cannot tell."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# ---- scheduling ------------------------------------------------------------------------------------


def _sched_idle() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def _sched_normal() -> bool:
    """Every thread of this process back to ``SCHED_OTHER``; False when one could not be moved."""
    ok = True
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that just ended
        except (AttributeError, OSError):
            ok = False
    return ok


# ---- the process -----------------------------------------------------------------------------------


class Channel:
    """The private ends of the launcher's pipes (fds duplicated away from 0 and 1)."""

    def __init__(self, read_fd: int, write: BinaryIO) -> None:
        self.read_fd = read_fd
        self.write = write
        self._buf = b""

    @classmethod
    def take_stdio(cls) -> Channel:
        read_fd = os.dup(0)
        write = os.fdopen(os.dup(1), "wb", buffering=0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)  # the job's prints go to the log with its stderr
        return cls(read_fd, write)

    def send(self, **record: Any) -> bool:
        try:
            self.write.write(json.dumps(record).encode() + b"\n")
        except OSError:  # the launcher went away
            return False
        return True

    def read_line(self, timeout_s: float) -> bytes | None:
        """One line, ``b""`` at end of file, ``None`` when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([self.read_fd], [], [], min(remaining, 1.0))
            if not readable:
                continue
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                return b""
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                raise ProtocolError(f"assignment longer than {MAX_LINE} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def watch_eof(self) -> None:
        """After the assignment: the launcher going away (end of file) ends this worker at once."""

        def watch() -> None:
            while True:
                try:
                    readable, _, _ = select.select([self.read_fd], [], [], 3600.0)
                    if readable and not os.read(self.read_fd, 65536):
                        break
                except OSError:
                    break
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="ftd-warm-launcher-watch", daemon=True).start()


@dataclass(frozen=True)
class JobEntry:
    """What a standby runs: ``run(argv, prepared)`` at activation and, when the job opts in (a
    ``prepare`` next to a two-argument ``main``), ``prepare(argv)`` before it reports ready."""

    name: str
    run: Callable[[list[str], object], object]
    prepare: Callable[[list[str]], object] | None = None


@dataclass(frozen=True)
class Prepared:
    """The outcome of a job's ``prepare`` in a standby: the context, or why there is none."""

    context: object = None
    ok: bool = False
    seconds: float | None = None  # None: the job has no prepare
    argv: tuple[str, ...] = ()  # the arguments prepare saw
    error: str = ""


def script_opts_in(source: str) -> bool:
    """Whether a script's source defines ``prepare`` and ``main`` at top level (then it is imported
    ahead, its ``__main__`` block skipped); a script that does not parse does not opt in."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {"prepare", "main"} <= defined


def takes_two_arguments(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called as ``fn(argv, prepared)``."""
    try:
        inspect.signature(fn).bind(None, None)
    except (TypeError, ValueError):  # ValueError: no signature to tell
        return False
    return True


def _call_with_argv(fn: Callable[..., Any], argv: list[str]) -> object:
    return fn(argv) if takes_argument(fn) else fn()


def _import_script(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[SCRIPT_MODULE] = module  # its classes pickle by reference, as a module's do
    spec.loader.exec_module(module)
    return module


def load_entry(entry: str) -> JobEntry:
    """Imports the entry now; returns what runs it (:class:`JobEntry`)."""
    kind, target, function = parse_entry(entry)
    if kind == "path":
        script_dir = str(Path(target).resolve().parent)
        if script_dir not in sys.path:
            sys.path.insert(0, script_dir)  # as `python script.py` does
        if script_opts_in(Path(target).read_text(errors="replace")):
            return _function_entry(entry, target, _import_script(target), "main")

        def run_path(argv: list[str], prepared: object) -> object:
            sys.argv = [target, *argv]
            runpy.run_path(target, run_name="__main__")
            return 0

        return JobEntry(entry, run_path)
    module = importlib.import_module(target)
    if function is None and not callable(getattr(module, "main", None)):
        def run_module(argv: list[str], prepared: object) -> object:
            sys.argv = [target, *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
            return 0

        return JobEntry(entry, run_module)
    return _function_entry(entry, target, module, function or "main")


def _function_entry(entry: str, target: str, module: ModuleType, function: str) -> JobEntry:
    """``function`` of ``module``, with the module's ``prepare`` when ``function`` takes its result."""
    fn = getattr(module, function, None)
    if not callable(fn):
        raise AttributeError(f"module {target} has no callable {function}")
    prepare = getattr(module, "prepare", None)
    if callable(prepare) and not takes_two_arguments(fn):
        print(f"warm worker {os.getpid()}: {target} defines prepare() but its {function}() takes no second "
              f"argument for what prepare returned: prepare is not used", file=sys.stderr)
        prepare = None
    if not callable(prepare):
        def run_function(argv: list[str], prepared: object) -> object:
            sys.argv = [target, *argv]
            return _call_with_argv(fn, argv)

        return JobEntry(entry, run_function)

    def run_prepared(argv: list[str], prepared: object) -> object:
        sys.argv = [target, *argv]
        return fn(argv, prepared)

    def prepare_job(argv: list[str]) -> object:
        sys.argv = [target, *argv]
        return _call_with_argv(prepare, argv)

    return JobEntry(entry, run_prepared, prepare_job)


def run_prepare(job: JobEntry, argv: list[str], clock: Callable[[], float] = time.monotonic) -> Prepared:
    """Runs the job's ``prepare`` (if any); an exception is printed (the log) and returned as the error,
    ``SystemExit`` too (argparse's on a bad flag): the job's ``main`` then meets it itself, as a
    worker's failure its launcher sees."""
    if job.prepare is None:
        return Prepared()
    started = clock()
    try:
        context = job.prepare(list(argv))
    except (Exception, SystemExit) as exc:
        traceback.print_exc()
        return Prepared(None, False, round(clock() - started, 4), tuple(argv), f"{type(exc).__name__}: {exc}")
    return Prepared(context, True, round(clock() - started, 4), tuple(argv))


def context_for(prepared: Prepared, argv: list[str]) -> object:
    """What ``main`` receives as ``prepared``: the context, unless the assignment's arguments are not
    the ones ``prepare`` saw (it was built for another job)."""
    if not prepared.ok:
        return None
    if tuple(argv) != prepared.argv:
        print(f"warm worker {os.getpid()}: the assignment's arguments {argv} are not the ones prepare() saw "
              f"{list(prepared.argv)}: main runs without the prepared context", file=sys.stderr)
        return None
    return prepared.context


def run_entry(job: JobEntry, argv: list[str], prepared: object = None) -> int:
    try:
        return exit_code(job.run(argv, prepared))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exit_code(exc.code)
        print(exc.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
        return 1
    except BaseException:  # the worker's failure, for its launcher to see as a non-zero exit
        traceback.print_exc()
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    channel = Channel.take_stdio()
    args_in = list(sys.argv[1:] if argv is None else argv)
    ours, job_args = (args_in[: args_in.index("--")], args_in[args_in.index("--") + 1:]) if "--" in args_in \
        else (args_in, [])
    ap = argparse.ArgumentParser(prog="python -m ftd.training.warm_worker")
    ap.add_argument("--entry", required=True, help="MODULE[:FUNCTION] or a script path")
    ap.add_argument("--wait-s", type=float, default=86400.0, help="exit 0 when no assignment came by then")
    ap.add_argument("--preload", action="append", default=[], metavar="MODULE",
                    help=f"import MODULE ahead too (repeatable; always: {', '.join(DEFAULT_PRELOAD)})")
    args = ap.parse_args(ours)
    background = os.environ.get(ENV_BACKGROUND) == "1" and _sched_idle()
    started = time.monotonic()
    for name in (*DEFAULT_PRELOAD, *args.preload):
        try:
            importlib.import_module(name)  # the point of a standby: imported before it is needed
        except Exception as exc:
            print(f"warm worker {os.getpid()}: cannot preload {name}: {exc!r}", file=sys.stderr)
    try:
        job = load_entry(args.entry)
    except Exception as exc:
        traceback.print_exc()
        channel.send(event="error", pid=os.getpid(), message=f"cannot import {args.entry}: {exc!r}")
        return EXIT_IMPORT
    import_s = time.monotonic() - started
    prepared = run_prepare(job, job_args)
    if prepared.error:
        channel.send(event="prepare_failed", pid=os.getpid(),
                     message=f"prepare() of {args.entry} raised {prepared.error}; its main will build everything "
                             f"after the assignment")
    if background and not _sched_normal():
        channel.send(event="error", pid=os.getpid(), message="cannot leave SCHED_IDLE")
        return EXIT_PROTOCOL
    os.environ.pop(ENV_BACKGROUND, None)
    age = process_age_s()
    if not channel.send(event="ready", pid=os.getpid(), import_s=round(import_s, 4),
                        startup_s=None if age is None else round(age, 3), entry=args.entry, protocol=PROTOCOL,
                        prepared=prepared.ok, prepare_s=prepared.seconds):
        return 0
    try:
        line = channel.read_line(args.wait_s)
        if line is None:
            print(f"warm worker {os.getpid()}: no assignment within {args.wait_s:g}s; exiting", file=sys.stderr)
            return 0
        if not line:
            return 0  # the launcher went away before needing us
        env, assigned_argv = parse_assignment(line)
    except ProtocolError as exc:
        print(f"warm worker {os.getpid()}: {exc}", file=sys.stderr)
        return EXIT_PROTOCOL
    os.environ.update(env)
    channel.watch_eof()
    channel.send(event="running", pid=os.getpid(), t=time.time())
    argv_now = job_args if assigned_argv is None else assigned_argv
    code = run_entry(job, argv_now, context_for(prepared, argv_now))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
