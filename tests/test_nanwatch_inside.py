"""A NaN made by a module's own code between two of its submodules (attention scores overflowing in
the attention module, then fed to its output projection) is born in that module, not "already in the
input data" of the submodule that consumes it.

With replay (the default) no op runs watched inside a model, so the submodule's call sees the NaN come
in; the enclosing call is replayed instead, and the report is the always-on watch's. Module mode names
the enclosing module. Data that really came in with NaN is still reported as input data, at the
submodule that first used it.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torch_nbdebug.api.nanwatch import NanReport, nanwatch

from nanwatch_paths import immediate_path, marker_line  # noqa: F401 - immediate_path: every test here, CPU path

SRC = open(__file__).read().splitlines()


@pytest.fixture(autouse=True, params=[True, False], ids=["cpu-read-at-exit", "device-read-with-the-model"])
def read_at_exit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_nbdebug.record.nanwatch.replay import outputs as nanwatch_modules

    monkeypatch.setattr(nanwatch_modules, "READ_AT_EXIT", request.param)


def line(marker: str) -> int:
    return marker_line(SRC, marker)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        q, k = self.qk(x).split(8, -1)
        scores = q @ k.transpose(-1, -2)  # @inside-scores
        return self.proj(scores.softmax(-1) @ k)  # @inside-proj


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return self.head(self.attn(x, cache))  # @inside-net


class Masked(nn.Module):
    """Makes a NaN between its submodules and throws it away before returning: its output is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(self.fc(x) - 10)  # @inside-log
        return torch.nan_to_num(self.out(h))


def overflowing() -> Net:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.attn.qk.weight.mul_(1e21)
    return net


def watch(net: nn.Module, x: torch.Tensor, cache: Any = None, **options: Any) -> NanReport:
    with nanwatch(namespace={"net": net}, **options) as report:
        net(x, cache).sum().backward() if cache is not None else net(x).sum().backward()
    return report


def first(report: NanReport) -> tuple[Any, ...]:
    e = report.first
    assert e is not None, report.text
    return e.phase, e.op, e.module, e.lineno


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "always-on"])
def test_a_nan_made_between_two_submodules_is_born_in_the_enclosing_module(replay: bool) -> None:
    x = torch.randn(2, 5, 8)
    report = watch(overflowing(), x, replay=replay)
    assert first(report) == ("forward", "aten.bmm.default", "net.attn", line("@inside-scores"))
    assert report.first.cause is None and report.first.hint and "dataset" not in report.first.hint


class Cache:
    """An object a forward may update (a KV cache): a call taking one is never replayed."""


def test_when_no_enclosing_call_can_be_replayed_the_module_whose_code_made_it_is_named() -> None:
    x = torch.randn(2, 5, 8)
    replayed = watch(overflowing(), x, cache=Cache(), replay=True)
    assert first(replayed) == ("forward", "Attn (module output)", "net.attn", line("@inside-proj"))
    assert any("net.attn: its own code made" in note for note in replayed.notes), replayed.notes


def test_a_replayable_model_call_is_replayed_when_the_enclosing_call_is_not() -> None:
    """The attention call takes a cache object it may update: it cannot be replayed, but the model's call
    (given no cache: the model makes one) can, and names the op as the always-on watch does."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = overflowing()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x, Cache())

    x = torch.randn(2, 5, 8)
    reports = []
    for replay in (False, True):
        model = Outer()
        with nanwatch(namespace={"model": model}, replay=replay) as report:
            model(x).sum().backward()
        reports.append(report)
    assert first(reports[0]) == first(reports[1]) == ("forward", "aten.bmm.default", "model.net.attn",
                                                      line("@inside-scores"))


def test_a_nan_made_and_thrown_away_inside_a_module_is_still_found_by_replay() -> None:
    torch.manual_seed(0)
    model = Masked()
    x = torch.randn(3, 4)
    with nanwatch(namespace={"model": model}, replay=True) as replayed:
        model(x).sum().backward()
    with nanwatch(namespace={"model": model}, replay=False) as always:
        model(x).sum().backward()
    assert first(replayed)[:3] == first(always)[:3] == ("forward", "aten.log.default", "model")
    assert replayed.first.lineno == always.first.lineno == line("@inside-log")


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_module_mode_names_the_module_whose_own_code_made_it(defer: bool) -> None:
    x = torch.randn(2, 5, 8)
    report = watch(overflowing(), x, mode="module", defer=defer)
    phase, op, module, _ = first(report)
    assert (phase, op, module) == ("forward", "Attn (module output)", "net.attn")


@pytest.mark.parametrize("options", [dict(replay=True), dict(replay=False), dict(mode="module"),
                                     dict(mode="module", defer=True)],
                         ids=["replay", "always-on", "module", "module-deferred"])
def test_data_that_came_in_with_nan_is_still_input_data_at_the_submodule_that_used_it(options: dict) -> None:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 5, 8)
    x[0, 0, 0] = float("nan")
    report = watch(net, x, **options)
    e = report.first
    assert e is not None and e.phase == "input" and e.module == "net.attn.qk", report.text


@pytest.mark.parametrize("options", [dict(replay=True), dict(mode="module")], ids=["replay", "module"])
def test_a_clean_step_with_the_loss_inside_the_model_says_what_was_checked(options: dict) -> None:
    """No op runs outside the model (a Hugging Face model computes its own loss): the module calls were
    checked, and a clean report says so instead of "no op was checked, so this says nothing"."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).square().mean()

    torch.manual_seed(0)
    model = WithLoss()
    with nanwatch(namespace={"model": model}, **options) as report:
        model(torch.randn(2, 5, 8)).backward()
    assert report.first is None and report.summary.ops_checked == 0
    assert report.text().startswith("nanwatch: no NaN/Inf born (0 ops and 6 module calls checked"), report.text()
    assert "says nothing" not in report.text() and 'class="card ok"' in report.html()


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "always-on"])
def test_a_nan_row_of_an_embedding_is_named_as_the_parameter_it_came_from(replay: bool) -> None:
    """``embedding`` only copies rows (no check watches it): the next op sees the NaN come in, and the
    parameter it was copied from is named, without a note blaming randomness for a replay that found no op."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[3] = float("nan")
    with nanwatch(namespace={"model": model}, replay=replay) as report:
        model(torch.tensor([[1, 3, 5]])).sum().backward()
    e = report.first
    assert e is not None and e.phase == "input" and e.param == "model.0.weight", report.text()
    assert e.cause == "nonfinite_parameter" and not report.notes


class Buckets(nn.Module):
    """T5's relative-position buckets: ``log(0)`` is -Inf, scaled, cast to ``long`` and selected away."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 2)

    def forward(self, distance: torch.Tensor) -> torch.Tensor:
        large = 4 + (torch.log(distance.float() / 4) / 0.7 * 4).to(torch.long)  # @inside-bucket
        return self.emb(torch.where(distance < 4, distance, large.clamp(max=7)))


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "always-on"])
def test_an_inf_cast_to_integers_and_selected_away_is_no_birth(replay: bool) -> None:
    torch.manual_seed(0)
    model = Buckets()
    with nanwatch(namespace={"model": model}, replay=replay) as report:
        model(torch.arange(8)).sum().backward()
    assert report.first is None, report.text()
    if not replay:  # the always-on watch saw the log(0): listed as absorbed, not as a birth
        assert [(e.op, e.lineno) for e in report.absorbed] == [("aten.log.default", line("@inside-bucket"))]


class Generating(nn.Module):
    """A decoder step as ``generate`` runs it: under no_grad (outputs freed as the forward goes), with a cache
    object the call may update (so it is never replayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.act = nn.GELU()
        self.proj = nn.Linear(8, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.head(self.proj(self.act(self.fc(x))))


def test_a_freed_output_without_replay_is_one_module_level_birth_of_the_right_kind_with_a_note() -> None:
    torch.manual_seed(0)
    model = Generating()
    with torch.no_grad():
        model.fc.weight.fill_(3e38)  # fc's output is +Inf (finite inputs), the modules after it carry it
    with torch.no_grad(), nanwatch(namespace={"model": model}) as report:
        model(torch.ones(2, 4), Cache())
    births = [(e.op, e.module, e.kind) for e in report.events if e.module in ("model.fc", "model.act")]
    assert births == [("Linear (module output)", "model.fc", "inf")], report.text()
    assert not any(e.module == "model.act" for e in report.events)
    assert any("model.fc: its output was freed before the check" in n for n in report.notes), report.notes
    assert "--no-replay" in report.first.hint


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "always-on"])
def test_a_birth_that_reached_the_loss_stays_a_birth_when_a_metric_casts_it_to_integers(replay: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with nanwatch(namespace={"model": model}, replay=replay) as report:
        out = torch.log(model(torch.rand(3, 4)) - 10)  # @inside-metric
        loss = out.pow(2).mean()
        (out.round().long() == 0).sum()  # an accuracy-like metric, after the loss
        loss.backward()
    assert first(report)[:2] == ("forward", "aten.log.default") and not report.absorbed, report.text()
    assert report.first.lineno == line("@inside-metric")


# -- found by review: data coming in by keyword or through a view, in-place modules, two births --------
class ByKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor = None, cache: Any = None) -> torch.Tensor:  # type: ignore[assignment]
        return self.head(self.fc(x.reshape(-1, 8)))


@pytest.mark.parametrize("options", [dict(replay=True), dict(mode="module"), dict(mode="module", defer=True)],
                         ids=["replay", "module", "module-deferred"])
@pytest.mark.parametrize("cache", [False, True], ids=["", "cache"])
def test_bad_data_passed_by_keyword_and_reshaped_by_the_model_is_input_data(options: dict, cache: bool) -> None:
    """Hugging Face calls models by keyword (``model(inputs_embeds=x, past_key_values=cache)``): the data
    comes in, whatever view of it the model makes, and is reported where first used."""
    torch.manual_seed(0)
    net = ByKeyword()
    x = torch.randn(2, 1, 8)
    x[0, 0, 0] = float("nan")
    with nanwatch(namespace={"net": net}, **options) as report:
        net(x=x, cache=Cache() if cache else None).sum().backward()
    e = report.first
    assert e is not None and (e.phase, e.module) == ("input", "net.fc"), report.text()


def test_an_in_place_module_later_in_the_forward_does_not_hide_where_the_nan_was_made() -> None:
    """``ReLU(inplace=True)`` makes the kept outputs be checked before it runs, while the model still runs:
    a submodule whose inputs its parent made waits for the parent's check."""

    class WithInplace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = overflowing()
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.net.attn(x)).sum()

    model = WithInplace()
    with nanwatch(namespace={"model": model}, replay=True) as report:
        model(torch.randn(2, 5, 8)).backward()
    assert first(report) == ("forward", "aten.bmm.default", "model.net.attn", line("@inside-scores"))


class TwoBirths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(4, 4)
        self.a = Overflows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(x - 10)  # @inside-first-birth
        return self.c(h).sum() + self.a(x * 1e20).sum()


class Overflows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)  # @inside-second-birth


def test_two_independent_births_in_one_forward_are_both_named_by_replay_as_by_the_always_on_watch() -> None:
    torch.manual_seed(0)
    x = torch.rand(3, 4) + 1
    reports = []
    for replay in (False, True):
        model = TwoBirths()
        with nanwatch(namespace={"model": model}, replay=replay) as report:
            model(x).backward()
        reports.append([(e.phase, e.op, e.module, e.lineno) for e in report.events if e.phase == "forward"])
    assert reports[0] == reports[1] == [("forward", "aten.log.default", "model", line("@inside-first-birth")),
                                        ("forward", "aten.exp.default", "model.a", line("@inside-second-birth"))]


def test_a_finite_parameter_cat_with_bad_data_is_not_blamed() -> None:
    """A ViT's class token is concatenated with the patch embeddings: NaN in the data, not in the token."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1))

    model = Tokens()
    x = torch.randn(2, 3, 4)
    x[0, 1, 1] = float("nan")
    for replay in (False, True):
        with nanwatch(namespace={"model": model}, replay=replay) as report:
            model(x).sum().backward()
        e = report.first
        assert e is not None and e.phase == "input" and e.param is None and e.cause == "input_data", report.text()
