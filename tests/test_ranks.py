"""``python -m torch_nbdebug TOOL script.py``, under torchrun and torch.multiprocessing on gloo: the report
document, which rank a NaN was born on, who sent it into DDP's all-reduce, a rank that died, a hang."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import torch_nbdebug
from torch_nbdebug.api.nanwatch import NanReport
from torch_nbdebug.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_NBDEBUG_TEST="1")

SCRIPT = """
import sys, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    x = torch.randn(8, 4)
    if i == 1:
        x = torch.log(x - 10)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print("args", sys.argv[1:], __name__)
sys.exit(int(sys.argv[1]))
"""

DDP = """
import sys, time, torch, torch.distributed as dist
mode = sys.argv[1]
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=4 if mode == "die" else 20))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2 if mode == "uneven" and rank == 1 else 3):
    out = model(torch.randn(8, 4))
    if mode == "nan" and rank == 1 and step == 1:
        out = out * torch.sqrt(torch.tensor(-1.0))
    loss = out.pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if mode == "hang" and rank == 1 and step == 1:
        time.sleep(60)
    if mode == "die" and rank == 1 and step == 1:
        import os, signal; os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""


def _cli(*args: str, cwd: Any = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_nbdebug", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def script_run(tmp_path_factory: Any) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    tmp_path = tmp_path_factory.mktemp("script")
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / "out"
    return out, _cli("nanwatch", "--out", str(out), "train.py", "3", cwd=tmp_path)


def test_script_runs_as_main_with_its_status_and_the_report_written(script_run: Any) -> None:
    out, proc = script_run
    assert proc.returncode == 3, proc.stderr
    assert "args ['3'] __main__" in proc.stdout
    assert {p.name for p in out.iterdir()} == {"rank-0.json", "report.json", "report.html"}
    doc = json.loads((out / "report.json").read_text())
    assert (doc["schema"], doc["version"], doc["tool"]) == ("torch_nbdebug.report", 1, "nanwatch")
    first = doc["findings"]["first"]
    # the birth is in the second iteration: one optimizer step completed before it
    assert (first["rank"], first["step"], first["event"]["op"], first["event"]["lineno"]) == (0, 1, "aten.log.default", 8)
    assert "first NaN/Inf: rank 0, step 1" in proc.stderr
    assert "<!DOCTYPE html>" in (out / "report.html").read_text() and "aten.log" in (out / "report.html").read_text()
    report = torch_nbdebug.load(out)
    assert isinstance(report, NanReport) and report.first.op == "aten.log.default"
    assert "aten.log.default" in report.text()


def test_nanwatch_magic_loads_a_script_runs_report(script_run: Any, ipython: Any) -> None:
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    out, _ = script_run
    with capture_output() as cap:
        ipython.run_line_magic("nanwatch", f"--load {out}")
    report = ipython.user_ns.pop("_nanwatch")
    assert isinstance(report, NanReport) and report.first.op == "aten.log.default"
    assert "aten.log.default" in cap.outputs[0].data["text/plain"]
    with pytest.raises(UsageError, match="no such report"):
        ipython.run_line_magic("nanwatch", f"--load {out / 'nothing.json'}")


def test_a_script_that_raises_gives_its_traceback_status_and_report(tmp_path: pathlib.Path) -> None:
    (tmp_path / "boom.py").write_text("import torch\ntorch.log(torch.zeros(2))\nraise KeyError('boom')\n")
    proc = _cli("nanwatch", "--out", "o", "boom.py", cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "KeyError: 'boom'" in proc.stderr and 'boom.py", line 3' in proc.stderr
    assert "torch_nbdebug/cli" not in proc.stderr  # the user's traceback, not ours
    part = json.loads((tmp_path / "o" / "rank-0.json").read_text())["ranks"][0]
    assert part["status"] == "raised" and part["error"] == "KeyError: 'boom'"
    assert part["report"]["events"][0]["op"] == "aten.log.default"


@pytest.mark.parametrize("args, message", [
    (["nanwatsh", "x.py"], "invalid choice: 'nanwatsh'"),
    (["nanwatch", "missing.py"], "no such script: missing.py"),
    (["nanwatch", "--frobnicate", "x.py"], "unrecognized arguments: --frobnicate"),
    (["nanwatch", "--mode", "fast", "x.py"], "invalid choice: 'fast'"),
    (["nanwatch"], "name the script to run"),
])
def test_bad_input_is_a_message_a_usage_line_and_status_2(tmp_path: pathlib.Path, args: list[str], message: str,
                                                          monkeypatch: Any, capsys: Any) -> None:
    (tmp_path / "x.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message in err and "usage: python -m torch_nbdebug" in err
    assert "Traceback" not in err


def test_help_lists_the_tools_and_a_tool_lists_the_magics_options(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    top = capsys.readouterr().out
    assert exit_.value.code == 0 and "nanwatch" in top and "cudamem" in top
    with pytest.raises(SystemExit):
        main(["nanwatch", "--help"])
    tool = capsys.readouterr().out
    for option in ("--mode", "--no-replay", "--raise", "--max-events", "--out", "--hang-timeout", "-m MODULE"):
        assert option in tool
    assert "--tensorboard" not in tool and "--load" not in tool
    # one process runs the whole CLI too (python -m torch_nbdebug is this main)
    proc = _cli("--help")
    assert proc.returncode == 0 and "cudamem" in proc.stdout


def test_dash_m_runs_a_module(tmp_path: pathlib.Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(SCRIPT)
    proc = _cli("cudamem", "--out", "o", "-m", "pkg.job", "0", "--not-ours", cwd=tmp_path)
    assert proc.returncode == 0 and "args ['0', '--not-ours'] __main__" in proc.stdout
    assert torch_nbdebug.load(tmp_path / "o").peak_bytes > 0


def test_grads_records_the_scripts_model_found_by_name(tmp_path: pathlib.Path, monkeypatch: Any,
                                                      capsys: Any) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # in this process: main() is what python -m torch_nbdebug runs
    assert main(["grads", "--model", "model", "-b", "8", "--out", "o", "train.py", "0"]) == 0
    report = torch_nbdebug.load(tmp_path / "o")
    assert report.steps == (0, 1, 2) and report.layer_names == ("model",)
    assert sys.modules["__main__"].__name__ == "__main__" and "model" not in vars(sys.modules["__main__"])
    assert main(["grads", "--model", "modle", "--out", "o2", "train.py", "0"]) == 0
    assert "no nn.Module named 'modle' was ever called" in capsys.readouterr().err


SLOW_DATA = """
import math, torch
class Decoded(torch.utils.data.Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        row = [math.sin(i * k) for k in range(20000)]
        return torch.tensor(row[:4]), torch.tensor(row[4:5])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in torch.utils.data.DataLoader(Decoded(), batch_size=16):
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_profile_names_the_slow_dataset_line_of_a_script(tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text(SLOW_DATA)
    proc = _cli("profile", "--warmup", "1", "--out", "o", "train.py", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    prof = torch_nbdebug.load(tmp_path / "o")
    assert prof.verdict.kind == "data"
    top = prof.by_line[0]
    assert top.filename.endswith("train.py") and top.lineno == 7, top  # the decoding line
    assert "report.json" in {p.name for p in (tmp_path / "o").iterdir()}


def test_notebook_reports_round_trip_through_to_json_and_load(tmp_path: pathlib.Path) -> None:
    with torch_nbdebug.nanwatch() as report:
        torch.log(torch.zeros(3))
    path = tmp_path / "r.json"
    path.write_text(report.to_json())
    again = torch_nbdebug.load(path)
    assert again.summary == report.summary
    with torch_nbdebug.memory_timeline() as tl:
        a = torch.randn(64, 64)
        del a
    path.write_text(tl.to_json())
    assert torch_nbdebug.load(path).to_dict() == tl.to_dict()
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    report_g = torch_nbdebug.grads(model)
    for text in (report_g.to_json(), report_g.trace.to_json()):  # the document, and a bare trace as before
        path.write_text(text)
        assert torch_nbdebug.load(path).trace.to_dict() == report_g.trace.to_dict()
    path.write_text('{"schema": "torch_nbdebug.report", "version": 99, "tool": "nanwatch"}')
    with pytest.raises(ValueError, match="version 99"):
        torch_nbdebug.load(path)


def _torchrun(tmp_path: pathlib.Path, mode: str, *options: str, timeout: int = 90) -> subprocess.CompletedProcess:
    (tmp_path / "ddp.py").write_text(DDP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "torch_nbdebug", "nanwatch", "--out", str(tmp_path / "out"), *options, "ddp.py", mode]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=timeout)


def test_torchrun_names_the_rank_step_and_who_sent_it_into_ddps_all_reduce(tmp_path: pathlib.Path) -> None:
    proc = _torchrun(tmp_path, "nan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = torch_nbdebug.load(tmp_path / "out")
    f = report.findings
    assert (f["first"]["rank"], f["first"]["step"], f["first"]["event"]["op"]) == (1, 1, "aten.sqrt.default")
    [sent] = f["sent"]  # later all-reduces only pass the NaN on
    assert (sent["senders"], sent["receivers"], sent["bucket"], sent["step"], sent["op"]) == ([1], [0], 0, 1, "allreduce")
    assert f["receivers"] == [0]
    assert "rank 1 sent" in proc.stderr and "rank 0 only received them" in proc.stderr
    assert report.rank(0).events  # rank 0's own report still lists what it saw (received, not a birth)
    shown = report._repr_mimebundle_()  # in a notebook: the findings over a tab per rank with its own widget
    assert "application/vnd.jupyter.widget-view+json" in shown and "rank 1 sent" in shown["text/plain"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank-0.json", "rank-1.json", "report.html",
                                                                    "report.json"]


def test_torchrun_hang_gives_stacks_the_waiting_collective_and_ends_the_run(tmp_path: pathlib.Path) -> None:
    proc = _torchrun(tmp_path, "hang", "--hang-timeout", "2")
    assert proc.returncode != 0
    report = torch_nbdebug.load(tmp_path / "out")
    hang = report.findings["hang"]
    assert hang["waiting"] == [0] and hang["op"] == "allreduce" and hang["step"] == 2
    fr = hang["flight_recorder"]  # torch's own record of the collective it waits in (turned on by --hang-timeout)
    assert fr["profiling_name"] == "gloo:all_reduce" and fr["input_sizes"] == [[5]]
    assert [m["rank"] for m in hang["missing"]] == [1]
    zero = report.ranks[0]
    assert zero["status"] == "hung" and any(s["main"] for s in zero["stacks"])
    one = report.ranks[1]
    assert one["status"] == "terminated" and any("time.sleep" in fr["text"] for s in one["stacks"]
                                                  for fr in s["frames"])


def test_torchrun_uneven_batches_name_the_rank_that_finished_early_and_ddp_join(tmp_path: pathlib.Path) -> None:
    proc = _torchrun(tmp_path, "uneven", "--hang-timeout", "3")
    assert proc.returncode != 0
    hang = torch_nbdebug.load(tmp_path / "out").findings["hang"]
    assert hang["waiting"] == [0] and hang["step"] == 2 and hang["bucket"] == 0
    [missing] = hang["missing"]
    assert missing["rank"] == 1 and "had finished" in missing["why"] and "join" in missing["why"]


MEMORY = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
held = [torch.zeros(1 << 20) for _ in range(1 + 3 * rank)]  # rank 1 holds 12 MiB more than rank 0
t = torch.ones(8)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_torchrun_cudamem_gives_a_timeline_per_rank_and_the_imbalance(tmp_path: pathlib.Path) -> None:
    (tmp_path / "mem.py").write_text(MEMORY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "torch_nbdebug", "cudamem", "--out", "out", "mem.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = torch_nbdebug.load(tmp_path / "out")
    mem = report.findings["memory"]
    assert mem["max_rank"] == 1 and 12 * 2 ** 20 <= mem["imbalance_bytes"] < 13 * 2 ** 20
    assert report.rank(1).peak_bytes - report.rank(0).peak_bytes == mem["imbalance_bytes"]
    assert "imbalance 12.0 MiB" in proc.stderr and "highest on rank 1" in proc.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    assert page.count("<h3>rank ") == 2 and "display:flex" in page


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, directory: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    os.chdir(directory)
    from torch_nbdebug.cli import main

    sys.exit(main(["nanwatch", "--out", "out", "ddp.py", "die"]))


def test_multiprocessing_rank_killed_mid_run_leaves_its_part_and_is_named(tmp_path: pathlib.Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    port = _free_port()
    ctx = mp.get_context("spawn")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT)
    try:
        procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path))) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    assert procs[1].exitcode == -signal.SIGKILL
    assert procs[0].exitcode != 0  # its all-reduce failed when rank 1 went away
    report = torch_nbdebug.load(tmp_path / "out")
    [died] = report.findings["died"]
    assert died["rank"] == 1 and "before collective" in died["why"]
    assert report.ranks[1]["status"] == "running" and report.ranks[1]["steps"] >= 1
    assert "rank 1 died" in report.text()


def _part(rank: int, **values: Any) -> dict[str, Any]:
    from torch_nbdebug.data import ranks as data

    return data.rank_part("nanwatch", rank, 3, **values)["ranks"][0]


def _birth(step: int, order: int, phase: str = "forward", op: str = "aten.log.default") -> dict[str, Any]:
    return {"step": step, "order": order, "event": {"phase": phase, "op": op, "title": op, "iteration": step + 1}}


def test_first_across_ranks_is_by_step_and_op_order_not_by_rank_or_time() -> None:
    from torch_nbdebug.data.ranks import document
    from torch_nbdebug.process.ranks import findings

    # rank 1's birth was written later in wall-clock time but at an earlier step (and phase): it is first
    ranks = [_part(0, status="finished", updated=1e9, births=[_birth(4, 0)]),
             _part(1, status="finished", updated=2e9, births=[_birth(3, 5, "backward")]),
             _part(2, status="finished", updated=1e9, births=[_birth(3, 0, "optimizer", "Adam.step")])]
    first = findings(document("nanwatch", ranks))["first"]
    assert (first["rank"], first["step"], first["event"]["phase"]) == (1, 3, "backward")


def test_a_rank_in_another_collective_is_named_as_a_collective_under_a_rank_condition() -> None:
    from torch_nbdebug.data.ranks import document
    from torch_nbdebug.process.ranks import findings

    wait = {"seq": 5, "op": "allreduce", "step": 2, "line": 30, "file": "t.py", "shapes": [[1]], "waited_s": 3.0}
    ranks = [_part(0, status="hung", hang=wait), _part(1, status="hung", hang=wait),
             _part(2, status="hung", hang=dict(wait, op="barrier", line=41))]
    hang = findings(document("nanwatch", ranks))["hang"]
    assert hang["waiting"] == [0, 1] and [m["rank"] for m in hang["missing"]] == [2]
    assert "collective #5 (barrier, line 41)" in hang["missing"][0]["why"]
    assert "if rank == 0" in hang["missing"][0]["why"]


def test_a_rank_whose_nan_came_from_a_collective_is_a_receiver_not_the_first_birth() -> None:
    from torch_nbdebug.data.ranks import document
    from torch_nbdebug.process.ranks import findings

    sent = {"seq": 9, "op": "allreduce", "step": 2, "bucket": 0, "sent_nonfinite": 3, "line": 14, "file": "t.py"}
    ranks = [_part(0, status="finished", births=[_birth(2, 0, "input", "aten.addmm.default")]),
             _part(1, status="finished", births=[_birth(2, 4, "backward", "SqrtBackward0")], sent=[sent]),
             _part(2, status="finished")]
    f = findings(document("nanwatch", ranks))
    assert (f["first"]["rank"], f["first"]["event"]["op"]) == (1, "SqrtBackward0")
    [s] = f["sent"]
    assert (s["senders"], s["receivers"], s["bucket"]) == ([1], [0, 2], 0) and f["receivers"] == [0, 2]
