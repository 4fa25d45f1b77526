"""What one rank knows about the run it is part of: optimizer steps, collectives, stacks, hangs.

Composed with any recorder by :mod:`torch_nbdebug.api.ranks` (the recorders stay unchanged):

- :class:`StepClock` counts optimizer steps completed (a global optimizer step post-hook, removed in
  ``stop``) and remembers how many had completed when each of a recorder's iterations began, so a birth
  in iteration ``i`` gets ``step = steps completed before it`` (the first iteration is step 0).
- :class:`CollectiveLog` sees ``c10d`` ops (``dist.all_reduce`` and DDP's bucket all-reduce from its reducer
  in backward alike, on gloo and NCCL) through a kernel registered at their Autograd key with
  ``torch.library`` (removed in ``stop``): no other op pays anything, unlike a dispatch mode, which would put
  every op of the program through Python (8x slower on a small MLP). Tensors made under
  ``torch.inference_mode`` skip the Autograd key, so their collectives are not seen.
  Before each collective it counts the non-finite values going in and calls ``before`` (the rank file is
  written there, before the rank may block); a collective running longer than ``hang_timeout`` seconds is
  handed to ``on_hang`` from a watchdog thread.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from torch_nbdebug.record.compat import (FLIGHT_RECORDER_ENV, below_autograd, collective_work, current_autograd_node,
                                         drop_library, flight_recorder_dump)
from torch_nbdebug.record.source import user_position
from torch_nbdebug.record.tensors import tensors_in

KEEP = 64  # collectives kept in full; older ones only counted
KEEP_SENT = 16  # the first collectives this rank sent non-finite values into (the later ones only pass them on)


class StepClock:
    """Optimizer steps completed, and the step at which each of a recorder's iterations began
    (``next_iteration()``: the number the recorder gives the iteration after the one running now)."""

    def __init__(self, next_iteration: Optional[Callable[[], int]] = None) -> None:
        self.steps = 0
        self._next_iteration = next_iteration
        self._starts: list[tuple[int, int]] = [(1, 0)]  # (iteration, steps completed before it)
        self._handle: Any = None

    def start(self) -> None:
        self._handle = register_optimizer_step_post_hook(self._stepped)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self._next_iteration is not None:
            nxt = self._next_iteration()  # the recorder's next iteration starts after this step
            if nxt > self._starts[-1][0]:
                self._starts.append((nxt, self.steps))

    def step_of(self, iteration: int) -> int:
        """Optimizer steps completed before ``iteration`` began (its ``step``; 0 for the first)."""
        best = 0
        for it, steps in self._starts:
            if it > iteration:
                break
            best = steps
        return best


def nonfinite(tensors: list[Any]) -> int:
    """Non-finite elements in the floating-point tensors of ``tensors`` (one reduction each)."""
    count = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            count += int((~torch.isfinite(t)).sum())
    return count


COLLECTIVES = ("allreduce_", "allreduce_coalesced_", "allgather_", "allgather_coalesced_",
               "allgather_into_tensor_coalesced_", "_allgather_base_", "reduce_scatter_",
               "reduce_scatter_tensor_coalesced_",
               "_reduce_scatter_base_", "reduce_", "broadcast_", "gather_", "scatter_", "alltoall_", "alltoall_base_",
               "barrier", "monitored_barrier_", "send", "recv_", "recv_any_source_")


class CollectiveLog:
    """Every ``c10d`` op this rank entered, as plain dicts (see :data:`torch_nbdebug.data.ranks.SCHEMA`)."""

    def __init__(self, clock: StepClock, before: Callable[[dict[str, Any]], None],
                 hang_timeout: Optional[float] = None, on_hang: Optional[Callable[[dict[str, Any]], None]] = None,
                 count_nonfinite: bool = True) -> None:
        self.clock = clock
        self._library: Any = None
        self.before = before
        self.count_nonfinite = count_nonfinite
        self.entries: list[dict[str, Any]] = []
        self._sent: list[dict[str, Any]] = []
        self.total = 0
        self.last_progress = time.monotonic()
        self._buckets: tuple[int, int] = (-1, 0)  # (step, buckets all-reduced in its backward)
        self._hang_timeout = hang_timeout
        self._on_hang = on_hang
        self._stop = threading.Event()
        self._watchdog: Optional[threading.Thread] = None
        self.errors: list[str] = []

    # -- the kernels -----------------------------------------------------------------------
    def _register(self) -> None:
        c10d = torch.ops.c10d
        self._library = torch.library.Library("c10d", "IMPL")
        for name in COLLECTIVES:
            packet = getattr(c10d, name, None)
            if packet is None or "default" not in packet.overloads():
                continue
            self._library.impl(name, self._kernel(packet.default), "Autograd")

    def _kernel(self, op: Any) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            return self._call(op, args, kwargs)

        return kernel

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        entry = self._enter(func, args)
        try:
            self.before(entry)
        except Exception as exc:  # noqa: BLE001 - a failed write never stops the user's collective
            self.errors.append(f"the rank file could not be written before collective {entry['seq']}: {exc}")
        entry["_work"] = None
        try:
            with below_autograd():
                out = func(*args, **kwargs)
        except BaseException:
            entry["state"] = "failed"
            raise
        # The op only issues the collective: it completes when its Work does (dist.all_reduce waits on it
        # at once, DDP at the end of backward). The watchdog polls the Work; without one it is done now.
        work = None
        if self._watchdog is not None and isinstance(out, (tuple, list)) and out:
            work = collective_work(out[-1])
        if work is None:  # not watched: "issued" (its Work, which holds its tensors, is not kept)
            entry["state"] = "issued" if self._watchdog is None else "completed"
            entry["duration_s"] = round(time.monotonic() - entry["_t0"], 6)
            self.last_progress = time.monotonic()
        else:
            entry["_work"] = work
        return out

    def _done(self, entry: dict[str, Any]) -> None:
        entry["state"] = "completed"
        entry["duration_s"] = round(time.monotonic() - entry["_t0"], 6)
        entry["_work"] = None
        self.last_progress = time.monotonic()

    def waiting(self) -> Optional[dict[str, Any]]:
        """The oldest collective issued and not completed (its Work polled), or None."""
        oldest = None
        for entry in list(self.entries):
            work = entry.get("_work")
            if work is None or entry["state"] != "waiting":
                continue
            try:
                completed = work.is_completed()
            except RuntimeError:  # it failed: the rank's own error says how
                completed = True
            if completed:
                self._done(entry)
            elif oldest is None:
                oldest = entry
        return oldest

    def _enter(self, func: Any, args: Any) -> dict[str, Any]:
        tensors = tensors_in(args, 3)  # (the op's arguments, lists of lists of tensors among them)
        step = self.clock.steps
        bucket = None
        if current_autograd_node() is not None:  # DDP's reducer all-reduces its gradient buckets in backward
            last_step, count = self._buckets
            bucket = count if last_step == step else 0
            self._buckets = (step, bucket + 1)
        position = user_position(sys._getframe(1))
        self.total += 1
        entry = {
            "seq": self.total, "op": func._opname.strip("_"),
            "aten": str(func), "step": step, "bucket": bucket,
            "shapes": [list(t.shape) for t in tensors], "dtypes": sorted({str(t.dtype).replace("torch.", "")
                                                                         for t in tensors}),
            "sent_nonfinite": nonfinite(tensors) if self.count_nonfinite else 0,
            "file": position[0] if position else None, "line": position[1] if position else None,
            "function": position[2] if position else None, "state": "waiting", "started": time.time(),
            "_t0": time.monotonic(),
        }
        self.entries.append(entry)
        if entry["sent_nonfinite"] and len(self._sent) < KEEP_SENT:
            self._sent.append(entry)
        if len(self.entries) > KEEP:
            del self.entries[0]
        return entry

    def snapshot(self) -> list[dict[str, Any]]:
        """The kept entries as plain dicts (safe to write from another thread)."""
        return [_plain(e) for e in list(self.entries)]

    def sent(self) -> list[dict[str, Any]]:
        return [_plain(e) for e in self._sent]

    # -- the watchdog ----------------------------------------------------------------------
    def start(self) -> None:
        self._register()
        if self._hang_timeout is not None and self._on_hang is not None:
            self._watchdog = threading.Thread(target=self._watch, name="torch_nbdebug-hang-watchdog", daemon=True)
            self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()
        for entry in self.entries:
            entry["_work"] = None
        try:
            if self._library is not None:
                drop_library(self._library)
                self._library = None
        finally:
            if self._watchdog is not None:
                self._watchdog.join(timeout=1.0)
                self._watchdog = None

    def _watch(self) -> None:
        timeout = float(self._hang_timeout or 0)
        while not self._stop.wait(min(0.2, max(timeout / 10, 0.05))):
            pending = self.waiting()
            if pending is None:
                continue
            waited = time.monotonic() - pending["_t0"]
            if waited >= timeout:
                info = _plain(pending)
                info["waited_s"] = round(waited, 3)
                if self._on_hang is not None:
                    self._on_hang(info)  # writes the rank file and ends the process
                return


def turn_on_flight_recorder(entries: int = 2000) -> None:
    """Have process groups made from now on record their collectives in Flight Recorder (unless the user
    chose a buffer size already): its record is what a hung rank reports first."""
    if not any(os.environ.get(name) for name in FLIGHT_RECORDER_ENV):
        os.environ[FLIGHT_RECORDER_ENV[0]] = str(entries)


def flight_recorder_wait() -> Optional[dict[str, Any]]:
    """The oldest collective Flight Recorder holds as not completed, and each group's status, or None."""
    text = flight_recorder_dump()
    try:
        dump = json.loads(text) if text else None
    except ValueError:
        return None
    if not dump or not dump.get("entries"):
        return None
    pending = [e for e in dump["entries"] if not e.get("retired") and e.get("state") != "completed"]
    if not pending:
        return None
    entry = min(pending, key=lambda e: (e.get("pg_id", 0), e.get("collective_seq_id", 0)))
    keys = ("collective_seq_id", "profiling_name", "state", "input_sizes", "input_dtypes", "process_group",
            "timeout_ms", "is_p2p")
    return dict({k: entry.get(k) for k in keys}, pg_status=dump.get("pg_status", {}), version=dump.get("version"))


def _plain(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if not k.startswith("_")}


_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def thread_stacks() -> list[dict[str, Any]]:
    """Every thread's Python stack, innermost frame last: ``[{"thread", "main", "frames": [{file, line,
    function, text}]}]``, without torch_nbdebug's own threads and frames (the main thread first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident, "").startswith("torch_nbdebug"):
            continue
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name, "text": (f.line or "").strip()}
                  for f in traceback.extract_stack(frame)
                  if not f.filename.startswith(_OURS) and not f.filename.startswith("<frozen")]
        stacks.append({"thread": names.get(ident, str(ident)), "main": ident == threading.main_thread().ident,
                       "frames": frames})
    stacks.sort(key=lambda s: not s["main"])
    return stacks
