"""One rank of a script run: the tool's recorder, unchanged, plus the rank's step clock, collective log,
rank file and hang watchdog; and ``load(DIR or file)``, which gives the report back.

A rank writes ``DIR/rank-R.json`` (atomically) before each collective (its births encoded again only when
there are new ones), at exit, on SIGTERM and when it hangs; rank 0 merges the rank files into
``DIR/report.json`` and ``DIR/report.html`` at exit (it reads
files, never a collective that may hang); :func:`load` merges them again, so a report is complete even
when rank 0 died first.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional, Union

from torch_nbdebug.data import ranks as data
from torch_nbdebug.process.ranks import findings
from torch_nbdebug.record.collectives import CollectiveLog, StepClock, flight_recorder_wait, thread_stacks
from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.render.bundle import Displayable

__all__ = ["load", "RunReport", "RankSession"]

HANG_STATUS = 124  # the status `timeout` uses: the run was ended because it stopped making progress
MERGE_WAIT_S = 5.0  # how long rank 0 waits at exit for the other ranks' last writes


class RunReport(Displayable):
    """A report gathered from the ranks of a run: text, static HTML and one widget per rank."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.document = dict(doc, findings=findings(doc))

    @property
    def tool(self) -> str:
        return self.document["tool"]

    @property
    def findings(self) -> dict[str, Any]:
        return self.document["findings"]

    @property
    def ranks(self) -> list[dict[str, Any]]:
        return self.document["ranks"]

    def rank(self, rank: int) -> Any:
        """Rank ``rank``'s own report object (a NanReport, MemoryTimeline or GradTrace), or None."""
        for part in self.ranks:
            if part["rank"] == rank:
                return tool_object(self.tool, part.get("report"))
        raise KeyError(f"no rank {rank} in this report (ranks: {[p['rank'] for p in self.ranks]})")

    def to_dict(self) -> dict[str, Any]:
        return self.document

    def to_json(self) -> str:
        return json.dumps(self.document, allow_nan=False, default=data._plain)

    def text(self) -> str:
        from torch_nbdebug.render.ranks import run_text

        return run_text(self.document, [self.rank(p["rank"]) for p in self.ranks])

    def html(self) -> str:
        from torch_nbdebug.render.ranks import run_html

        return run_html(self.document, [self.rank(p["rank"]) for p in self.ranks])

    def widget(self) -> Any:
        from torch_nbdebug.render.ranks import run_widget

        return run_widget(self.document, [self.rank(p["rank"]) for p in self.ranks])


def tool_object(tool: str, report: Optional[dict[str, Any]]) -> Any:
    """The notebook's report object for one rank's ``report`` dict."""
    if report is None:
        return None
    if tool == "nanwatch":
        from torch_nbdebug.api.nanwatch import NanReport
        from torch_nbdebug.data.nanwatch import NanSummary

        return NanReport(NanSummary.from_dict(report))
    if tool == "cudamem":
        from torch_nbdebug.api.memory import MemoryTimeline
        from torch_nbdebug.data.memory import MemoryTimeline as Data

        return MemoryTimeline.from_data(Data.from_dict(report))
    if tool == "grads":
        from torch_nbdebug.api.grads import GradReport
        from torch_nbdebug.data.grads import GradTrace

        return GradReport(GradTrace.from_dict(report))
    if tool == "profile":
        from torch_nbdebug.api.profile import Profile
        from torch_nbdebug.data.profile import ProfileData

        return Profile(None, 0, data=ProfileData.from_dict(report))
    raise ValueError(f"cannot load a {tool!r} report with this torch_nbdebug")


def load(path: Union[str, os.PathLike]) -> Any:
    """The report in ``path`` (a ``--out`` directory, its ``report.json``, a ``rank-R.json`` or a file written
    from ``report.to_json()``): the tool's own report object for one rank, a :class:`RunReport` for several."""
    doc = data.read(path)
    if doc["world_size"] == 1 and len(doc["ranks"]) == 1 and doc["ranks"][0].get("report") is not None:
        return tool_object(doc["tool"], doc["ranks"][0]["report"])
    return RunReport(doc)


class RankSession:
    """One rank of a run under ``tool``: ``start()``, run the script, ``finish(status, error)``."""

    def __init__(self, tool: str, out: Union[str, os.PathLike], context: Any, *,
                 births: Optional[Callable[[], list[Any]]] = None, iteration: Optional[Callable[[], int]] = None,
                 hang_timeout: Optional[float] = None, on_hang_exit: Callable[[int], None] = os._exit) -> None:
        self.tool, self.out, self.context = tool, pathlib.Path(out), context
        self.rank, self.world_size = _rank_world()
        self.path = data.rank_file(self.out, self.rank)
        self._births = births
        self.clock = StepClock(iteration)
        self.collectives = CollectiveLog(self.clock, self._before, hang_timeout, self._hung,
                                         count_nonfinite=tool == "nanwatch")
        self._exit = on_hang_exit
        self._lock = threading.Lock()
        self._written_births = -1
        self._births_json: Optional[str] = None
        self._signals: dict[int, Any] = {}
        self._scope = HookScope()
        self.result: Any = None
        self.part = data.rank_part(tool, self.rank, self.world_size, host=socket.gethostname(), pid=os.getpid(),
                                   argv=list(sys.argv))["ranks"][0]

    # -- lifetime --------------------------------------------------------------------------
    def start(self) -> Any:
        self.out.mkdir(parents=True, exist_ok=True)
        self._write()
        self.result = self.context.__enter__()
        self._scope.open(self._install)
        return self.result

    def _install(self, scope: HookScope) -> None:
        """The step clock, the collective log and the SIGTERM handler; each undo is listed before its
        install, so a half-done install is undone too."""
        scope.callback(self.clock.stop)
        self.clock.start()
        scope.callback(self.collectives.stop)
        self.collectives.start()
        scope.callback(self._restore_signals)
        self._install_signals()

    def _stop_recording(self) -> None:
        self._scope.close()  # the signals, the collective log, then the clock: each undone even if one fails

    def finish(self, exc: Optional[BaseException], exit_code: int) -> Optional[RunReport]:
        """Stop recording, write the rank file (status, report); rank 0 merges and returns the run report."""
        try:
            self._stop_recording()
        finally:
            self.context.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        status = "finished" if exc is None or exit_code == 0 else "raised"
        report = self.result.to_dict() if self.result is not None else None
        note = getattr(self.result, "note", None)
        if callable(note) and note():
            self.collectives.errors.append(note())
        self._update(status=status, exit_code=exit_code, report=report, error=_one_line(exc) if status != "finished"
                     else None, births=self._final_births(report))
        self._write()
        if self.rank != 0:
            return None
        try:
            return self.merge()
        except Exception as err:  # noqa: BLE001 - the rank files are written; the script's status stands
            print(f"torch_nbdebug could not merge the report in {self.out}: {type(err).__name__}: {err} (the rank "
                  f"files are there: torch_nbdebug.load({str(self.out)!r}))", file=sys.stderr)
            return None

    def merge(self, wait: float = MERGE_WAIT_S) -> RunReport:
        """Wait (briefly) for every rank's last write, then write report.json and report.html."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            doc = data.read(self.out)
            if len(doc["ranks"]) >= self.world_size and not any(p["status"] == "running" and _alive(p)
                                                                 for p in doc["ranks"]):
                break
            time.sleep(0.05)
        report = RunReport(data.read(self.out))
        data.write_atomic(self.out / data.REPORT_FILE, report.document)
        (self.out / data.HTML_FILE).write_text(_page(report), encoding="utf-8")
        return report

    # -- writes ----------------------------------------------------------------------------
    def _update(self, **values: Any) -> None:
        self.part.update(values)

    def _write(self, running: bool = False) -> None:
        """The rank file, now (``running``: before a collective, the births encoded when they last changed)."""
        with self._lock:
            self.part.update(steps=self.clock.steps, updated=time.time(), collectives=self.collectives.snapshot(),
                             collectives_total=self.collectives.total, sent=self.collectives.sent(),
                             notes=list(self.collectives.errors))
            doc = {"schema": data.SCHEMA, "version": data.VERSION, "tool": self.tool,
                   "world_size": self.world_size, "ranks": [self.part], "findings": None}
            births = self._births_json if running else None
            data.write_atomic(self.path, doc, {"births": births} if births is not None else None)

    def _before(self, entry: dict[str, Any]) -> None:
        """Before a collective: the births so far (when there are new ones) and the collective log."""
        if self._births is not None:
            events = self._births()
            if len(events) != self._written_births:
                self.part["births"] = [self._stamp(i, e) for i, e in enumerate(events)]
                self._births_json = json.dumps(self.part["births"], allow_nan=False, default=data._plain)
                self._written_births = len(events)
        self._write(running=True)

    def _stamp(self, order: int, event: Any) -> dict[str, Any]:
        data_ = event if isinstance(event, dict) else event.to_dict()
        iteration = int(data_.get("iteration", 1))
        # an optimizer birth's iteration is that optimizer's step number (1-based): the steps before it
        step = iteration - 1 if data_.get("phase") == "optimizer" else self.clock.step_of(iteration)
        return {"step": step, "order": order, "event": data_}

    def _final_births(self, report: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
        if report is None or self.tool != "nanwatch":
            return self.part.get("births", [])
        return [self._stamp(i, e) for i, e in enumerate(report.get("events", ()))]

    def _hung(self, info: dict[str, Any]) -> None:
        """The watchdog's call: this rank waited ``hang_timeout`` seconds in a collective."""
        info["flight_recorder"] = flight_recorder_wait()
        self._update(status="hung", hang=info, stacks=thread_stacks(),
                     exit_code=HANG_STATUS, error=f"no progress for {info['waited_s']:.1f}s in collective "
                                                  f"#{info['seq']} ({info['op']})")
        self._write()
        if self.rank == 0:
            report = self.merge(wait=min(MERGE_WAIT_S, 2.0))
            print(report.text(), file=sys.stderr, flush=True)
        self._exit(HANG_STATUS)

    # -- signals ---------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM,):
            self._signals[sig] = signal.signal(sig, self._signalled)

    def _restore_signals(self) -> None:
        for sig, old in self._signals.items():
            signal.signal(sig, old)
        self._signals.clear()

    def _signalled(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self._update(status="terminated", exit_code=128 + signum, stacks=thread_stacks(),
                     error=f"terminated by {name} (the launcher ends every rank when one fails)")
        self._write()
        self._restore_signals()
        os.kill(os.getpid(), signum)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _alive(part: dict[str, Any]) -> bool:
    """Whether the process that wrote ``part`` may still write again (a rank on another host: assume so)."""
    if part.get("host") != socket.gethostname() or not part.get("pid"):
        return True
    try:
        os.kill(part["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # killed but not yet reaped by its parent: a zombie writes nothing more
        with open(f"/proc/{part['pid']}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _one_line(exc: Optional[BaseException]) -> Optional[str]:
    if exc is None:
        return None
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _page(report: RunReport) -> str:
    from torch_nbdebug.render.ranks import page

    return page(report.html(), f"torch_nbdebug {report.tool} report")
