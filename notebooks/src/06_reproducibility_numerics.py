# %% [markdown]
# # 06 · Reproducibility and numerics
#
# A bug you cannot reproduce is a bug you cannot fix, and a model that trains on Monday but not on
# Tuesday is usually one of two things: **randomness you did not control**, or **floating point doing
# what floating point does**. This notebook covers both:
#
# 1. **Seeds** — which random number generators a training run uses, and how to pin all of them.
# 2. **Deterministic algorithms** — `torch.use_deterministic_algorithms`, the cuDNN flags, and why
#    the *same* seed can still give different numbers on a GPU.
# 3. **Clamping and epsilons** — `log`, division and `sqrt` near zero, forward and backward.
# 4. **Mixed precision** — what float16 cannot represent, why `GradScaler` exists, and what a
#    failed scale looks like in your logs.
# 5. **Which op broke it?** — `%%repro` runs a cell twice from the same state and names the first op
#    whose output differs, its line, and the cause.
#
# It runs on a CPU in seconds; GPU-only settings are explained and set harmlessly.

# %%
import os
import random

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

print("torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## 1. Seeds: one per random number generator
#
# A training run draws random numbers in several places: weight initialisation, dropout, data
# augmentation (often `random` or NumPy), the order of batches (`DataLoader(shuffle=True)`), and
# each `DataLoader` worker process. `torch.manual_seed(s)` seeds PyTorch's CPU generator **and**
# every CUDA device's generator; Python's `random` and NumPy have their own.
#
# A small training run that uses all of them:

# %%
def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and PyTorch (CPU and all GPUs); return a generator for the DataLoader."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


def tiny_run(seed: int, steps: int = 20) -> torch.Tensor:
    """Train a small MLP with dropout, shuffling and NumPy noise; return the final weights."""
    loader_generator = seed_everything(seed)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True,
                                         generator=loader_generator)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    done = 0
    while done < steps:
        for x, y in loader:
            x = x + torch.from_numpy(np.random.normal(0, 0.01, x.shape)).float()  # augmentation
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
    return torch.cat([p.detach().flatten() for p in model.parameters()])


run_a, run_b, run_c = tiny_run(seed=0), tiny_run(seed=0), tiny_run(seed=1)
print("same seed, bitwise equal:     ", torch.equal(run_a, run_b))
print("different seed, max |diff|:   ", (run_a - run_c).abs().max().item())
assert torch.equal(run_a, run_b) and not torch.equal(run_a, run_c)

# %% [markdown]
# Things that quietly break this:
#
# * **DataLoader workers** (`num_workers > 0`) each get their own seed derived from the loader's
#   generator; if your `Dataset` uses NumPy or `random` inside workers, seed them in a
#   `worker_init_fn` (`np.random.seed(torch.initial_seed() % 2**32)`).
# * **Drawing one more random number** anywhere (a new layer, a debug `torch.randn`) shifts every
#   later draw. Compare runs with the same code, or give each consumer its own `torch.Generator`.
# * **Python's `hash()` of strings** changes per process unless `PYTHONHASHSEED` is set — it matters
#   if you iterate over a `set` of strings to build a vocabulary.

# %% [markdown]
# ## 2. Deterministic algorithms, and why a seed is not enough on a GPU
#
# Floating-point addition is **not associative**: the order in which numbers are summed changes the
# result. Three numbers are enough to see it:

# %%
a, b, c = (torch.tensor(v, dtype=torch.float32) for v in (1e8, 1.0, -1e8))
left, right = (a + b) + c, (a + c) + b
print(f"(1e8 + 1) - 1e8 = {left.item()}    (1e8 - 1e8) + 1 = {right.item()}")
assert left.item() == 0.0 and right.item() == 1.0  # float32 has ~7 significant digits: 1e8 + 1 == 1e8

values = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
shuffled = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))]
print(f"sum in one order: {values.sum().item():.10f}\nsum in another:   {shuffled.sum().item():.10f}")

# %% [markdown]
# Many fast GPU kernels accumulate with **atomic adds**: thousands of threads add into the same memory
# in whatever order they finish. The order changes from run to run, so the last bits change, and
# training amplifies those bits over thousands of steps. Typical culprits on CUDA: `index_add_`,
# `scatter_add_`, the backward of `gather` and `index_select` (so of every lookup-table layer),
# `interpolate` backward, and some cuDNN convolution algorithms.
#
# The switches:
#
# | setting | what it does |
# |---|---|
# | `torch.use_deterministic_algorithms(True)` | use deterministic implementations; **raise** `RuntimeError` for an op that has none (so you learn which op it is) |
# | `torch.backends.cudnn.deterministic = True` | only deterministic cuDNN convolution algorithms |
# | `torch.backends.cudnn.benchmark = False` | do not time and pick the fastest algorithm per shape (that choice can differ between runs) |
# | `CUBLAS_WORKSPACE_CONFIG=:4096:8` | environment variable, set **before** CUDA starts; cuBLAS needs it to be deterministic |
#
# Determinism costs speed, so turn it on to *debug* ("is this difference a bug or noise?"), not by
# default. A context manager that restores the previous settings keeps the rest of the notebook
# unchanged:

# %%
from contextlib import contextmanager


@contextmanager
def deterministic():
    """Deterministic algorithms and cuDNN settings inside the block; the previous ones restored after."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # only effective before CUDA starts
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
        if saved[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def scatter_rows(device: str) -> torch.Tensor:
    """Add 200k rows into a 100-row table (many rows per slot): atomic adds on a GPU."""
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, 100, (200_000,), generator=generator).to(device)
    rows = torch.randn(200_000, 64, generator=generator).to(device)
    return torch.zeros(100, 64, device=device).index_add_(0, index, rows).cpu()


device = "cuda" if torch.cuda.is_available() else "cpu"
with deterministic():
    first, second = scatter_rows(device), scatter_rows(device)
print(f"on {device}, deterministic mode: two runs bitwise equal = {torch.equal(first, second)}")
assert torch.equal(first, second)
assert not torch.are_deterministic_algorithms_enabled()  # restored

# %% [markdown]
# On a CPU most kernels are deterministic anyway; on a GPU, run the two calls without the `with`
# line and compare again: `index_add_` with many rows per slot then typically differs in the last
# bits from run to run. (`use_deterministic_algorithms` switches it to a sorted, deterministic
# implementation; ops that have none raise an error that names them.)

# %% [markdown]
# ## 3. Clamping and epsilons: log, division and sqrt near zero
#
# Three functions cause most NaNs and Infs in loss code:
#
# * `log(x)` is `-inf` at `x = 0` and NaN for `x < 0`; its gradient `1/x` is `inf` at 0.
# * `a / b` is `inf` or NaN when `b = 0`.
# * `sqrt(x)` is fine at 0, but its **gradient** `1 / (2·sqrt(x))` is `inf` there — the forward looks
#   healthy and the NaN appears only after `backward()`.
#
# Watch the last one happen. The L2 distance between two identical embeddings is 0, and so is a
# perfectly fine loss value — yet the gradient is NaN (`inf · 0`):

# %%
def l2_distance(u, v):
    return torch.sqrt(((u - v) ** 2).sum(-1))


u = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
v = torch.tensor([[1.0, 2.0], [0.0, 0.0]])  # row 0: identical vectors
loss = l2_distance(u, v).sum()
loss.backward()
print("loss:", loss.item(), "\ngrad:", u.grad)
assert torch.isfinite(loss) and torch.isnan(u.grad[0]).all()

# %% [markdown]
# The fixes, each with a reason:
#
# * **Add an epsilon inside the root**: `sqrt(s + eps)`. The gradient is at most `1/(2·sqrt(eps))`.
# * **Clamp the argument of a log**: `log(p.clamp_min(eps))` — or better, never take the log of a
#   probability: use `log_softmax`, `F.cross_entropy`, `F.binary_cross_entropy_with_logits`, which
#   compute the log directly from logits and are exact where `log(softmax(x))` underflows.
# * **Denominators**: `x / (norm + eps)`, or `F.normalize(x, eps=...)`.
# * **Pick `eps` for the dtype.** An epsilon smaller than the dtype's resolution vanishes when added:
#   near 1.0, float16 resolves ~1e-3 and bfloat16 ~1e-2, so `1 + 1e-4` is exactly 1 in both (last
#   column below). `torch.finfo(dtype).eps` (resolution near 1) and `.tiny` (smallest normal number)
#   give the scale.

# %%
def l2_distance_safe(u, v, eps: float = 1e-12):
    return torch.sqrt(((u - v) ** 2).sum(-1) + eps)


u.grad = None
l2_distance_safe(u, v).sum().backward()
print("grad with eps:", u.grad)
assert torch.isfinite(u.grad).all()

p = torch.tensor([0.0, 0.5, 1.0])
print("log(p)                    :", torch.log(p))
print("log(p.clamp_min(1e-12))   :", torch.log(p.clamp_min(1e-12)))

logits = torch.tensor([[200.0, 0.0]])
print("log(softmax(x))           :", torch.log(torch.softmax(logits, -1)))  # softmax underflows to 0
print("log_softmax(x)            :", torch.log_softmax(logits, -1))          # exact
assert torch.isinf(torch.log(torch.softmax(logits, -1))).any()
assert torch.isfinite(torch.log_softmax(logits, -1)).all()

for dtype in (torch.float16, torch.bfloat16, torch.float32):
    info = torch.finfo(dtype)
    one_plus = (torch.tensor(1.0, dtype=dtype) + 1e-4).item()
    print(f"{str(dtype):>15}: max={info.max:.3g}  eps={info.eps:.3g}  tiny={info.tiny:.3g}"
          f"  1 + 1e-4 = {one_plus}")

# %% [markdown]
# The whole picture, measured with `torch.nextafter`: for every magnitude, the gap to the next
# representable number, relative to the number. A flat stretch is the normal range (the gap is
# `eps` times the number, with a sawtooth: the gap doubles at every power of two); on the left the
# subnormals lose precision until everything rounds to 0;
# each line stops at the dtype's largest number (dotted), beyond which is `inf`. An epsilon or an
# update smaller than the line is lost when added:

# %%
def relative_gaps(dtype, magnitudes):
    """Gap to the next representable number of ``dtype``, relative to it, where it is finite and > 0."""
    x = magnitudes.to(dtype)
    gap = torch.nextafter(x, torch.full_like(x, float("inf"))) - x
    keep = torch.isfinite(x) & (x > 0) & torch.isfinite(gap)
    return magnitudes[keep], (gap.double() / x.double())[keep]


magnitudes = torch.logspace(-12, 39, 1500, dtype=torch.float64)
fig, ax = plt.subplots(figsize=(8.5, 3.3), dpi=72)
for dtype, color in ((torch.float16, "#c0392b"), (torch.bfloat16, "#2f6fb0"), (torch.float32, "#555555")):
    where, gaps = relative_gaps(dtype, magnitudes)
    ax.loglog(where, gaps, color=color, label=str(dtype).removeprefix("torch."))
    ax.axvline(torch.finfo(dtype).max, color=color, ls=":", lw=1)
ax.axhline(1e-4, color="black", ls="--", lw=0.8)
ax.text(2e-12, 1.6e-4, "a relative change of 1e-4", fontsize=9)
ax.set_xlabel("magnitude of the number")
ax.set_ylabel("gap to the next number,\nrelative")
ax.set_title("Resolution and range of float16, bfloat16 and float32", loc="left")
ax.legend(loc="upper right", fontsize=9)
fig.tight_layout()
plt.show()

_, gaps16 = relative_gaps(torch.float16, torch.tensor([1.0], dtype=torch.float64))
assert gaps16.item() == torch.finfo(torch.float16).eps > 1e-4  # why 1 + 1e-4 == 1 in float16

# %% [markdown]
# ## 4. Mixed precision and `GradScaler`
#
# `torch.autocast` runs matrix multiplications in float16 (or bfloat16) for speed and memory.
# float16 has two limits you meet in training:
#
# * **Overflow**: the largest float16 is 65 504, so `exp(12)` is already `inf`.
# * **Underflow**: numbers below ~6e-8 become 0 — and small *gradients* are common.
#
# bfloat16 has float32's range (max ~3e38) with less precision, so it rarely overflows or
# underflows; prefer it where your hardware supports it. With float16, gradients are protected by
# **loss scaling**: multiply the loss by a large factor `S` before `backward()` so that small
# gradients stay representable, then divide the gradients by `S` before the optimizer step.

# %%
half = torch.float16
print("exp(12) in float16:      ", torch.exp(torch.tensor(12.0, dtype=half)).item())
print("1e-8 in float16:          ", torch.tensor(1e-8, dtype=half).item())
print("1e-8 * 65536 in float16:  ", torch.tensor(1e-8 * 65536, dtype=half).item(), "(scaled: survives)")
assert torch.tensor(1e-8, dtype=half).item() == 0.0 and torch.tensor(1e-8 * 65536, dtype=half).item() > 0

# %% [markdown]
# `torch.amp.GradScaler` picks `S` automatically. Each step it:
#
# 1. `scaler.scale(loss).backward()` — backward on `S · loss`;
# 2. `scaler.step(optimizer)` — unscales the gradients; **if any is `inf` or NaN, it skips
#    `optimizer.step()`** (the weights do not change);
# 3. `scaler.update()` — after a skipped step it **halves** `S`; after `growth_interval` clean steps
#    in a row it **doubles** `S`.
#
# So a few skipped steps at the start (the scale calibrating down from 65 536) are normal.
# A scale that keeps falling means the overflow is not from the scaling: the loss or the forward
# itself produces inf/NaN every step. Below, a small model trained under float16 autocast, with
# the loss made non-finite at steps 6–11 to simulate a real bug. We log the scale and whether the
# weights moved:

# %%
def train_with_scaler(steps: int = 14, bad_steps=range(6, 12)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu",
                                  init_scale=2.0**16, growth_interval=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    x, y = torch.randn(32, 16, device=device), torch.randn(32, 1, device=device)
    log = []
    for step in range(steps):
        before = model[0].weight.detach().clone()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        if step in bad_steps:
            loss = loss * float("inf")  # the bug: e.g. a log(0) in the loss
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scale = scaler.get_scale()
        scaler.update()
        moved = not torch.equal(before, model[0].weight)
        log.append((step, loss.item(), scale, scaler.get_scale(), moved))
    return log


log = train_with_scaler()
print(f"{'step':>4} {'loss':>10} {'scale used':>11} {'next scale':>11}  weights updated?")
for step, loss_value, used, nxt, moved in log:
    print(f"{step:>4} {loss_value:>10.4f} {used:>11.0f} {nxt:>11.0f}  {'yes' if moved else 'NO (skipped)'}")

skipped = [step for step, *_, moved in log if not moved]
assert all(step in skipped for step in range(6, 12))    # every non-finite loss skipped the step
assert log[-1][4] and log[12][3] < log[5][3]             # training resumed, with a smaller scale

# %% [markdown]
# The same log as a picture — what to plot from your own training logs:

# %%
steps = [step for step, *_ in log]
scale_used = [used for _, _, used, _, _ in log]
fig, ax = plt.subplots(figsize=(8.5, 2.8), dpi=72)
ax.axvspan(5.5, 11.5, color="#c0392b", alpha=0.08)
ax.text(8.5, max(scale_used), "the bug: a non-finite loss", ha="center", va="top", fontsize=9, color="#c0392b")
ax.step(steps, scale_used, where="mid", color="#2f6fb0", lw=1.2)
ax.scatter([s for s in steps if s not in skipped], [scale_used[s] for s in steps if s not in skipped],
           color="#27ae60", s=22, zorder=3, label="weights updated")
ax.scatter(skipped, [scale_used[s] for s in skipped], color="#c0392b", marker="x", s=36, zorder=3,
           label="step skipped (inf/NaN gradients)")
ax.set_yscale("log", base=2)
ax.set_xlabel("step")
ax.set_ylabel("loss scale used")
ax.set_title("GradScaler: calibration at step 0, a collapsing scale while the loss is broken", loc="left")
ax.legend(loc="lower left", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# How to read such a log:
#
# * **"NO (skipped)" at the very first steps, with the scale halving** — calibration: the first
#   scale was too large for this model. Harmless.
# * **Skips that keep coming while the scale shrinks towards 1 and below** — the model produces
#   inf/NaN by itself (steps 6–11 here). The scaler protects the weights from the bad update but
#   cannot fix the cause: the loss is not learning, and your logs show a flat loss. Find the birth
#   of the first non-finite value (notebook *02 · Hunting NaNs*, `%%nanwatch`), and consider
#   bfloat16.
# * **Never skipping, scale growing** — healthy.
#
# The same calibration happened here at step 0 (the scale halved from 65 536, no update).
# Check `scaler.get_scale()` in your training logs: a scale that collapses is a bug report.

# %% [markdown]
# ## 5. Which op broke it? `%%repro`
#
# The checklist above says *what* to set; it does not say *which op* of your cell makes two runs
# differ. `%%repro` runs the cell **twice from the same starting state** and compares the runs op by
# op (forward, backward and optimizer), keeping a small fingerprint of every output rather than a
# copy. Before each run it restores the modules, optimizers, LR schedulers, gradient scalers and
# tensors of the namespace and — unless `--no-restore-rng` — every random generator (torch CPU and
# CUDA, NumPy, Python `random`). Afterwards the state is as if the cell had run **once**: an
# optimizer stepped in the cell has stepped once. (Prints, files and appends to Python lists do
# happen twice.)
#
# If the runs differ, the report names the first op whose output differs although its inputs agreed
# — or whose input came from outside torch — with its module, line, phase and the size of the
# difference, and the cause:
#
# | cause | meaning |
# |---|---|
# | `rng` | randomness not restored or not seeded (a dropout mask, `torch.randn`, a private `torch.Generator`) |
# | `uninitialized` | memory from `torch.empty` read before it was written |
# | `external` | a value from outside torch's state: Python `random`, time, a counter the previous run changed, a file |
# | `nondeterministic_op` | same inputs, different output: atomic adds on CUDA, a nondeterministic algorithm |
# | `unknown` | the runs differ but no op explains it (state changed outside torch's ops) |
#
# A small model with dropout, trained one step per cell:

# %%
%load_ext torch_nbdebug

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
xb, yb = torch.randn(64, 8), torch.randn(64, 1)

# %%
%%repro
loss = F.mse_loss(net(xb), yb)
opt.zero_grad()
loss.backward()
opt.step()

# %% [markdown]
# Identical: the dropout mask came from the restored generator, so both runs drew the same one, and
# Adam stepped once (its step counter says 1). Now let the second run continue from the generator
# state the first one left — what happens when a cell does not seed and you re-run it:

# %%
assert _repro.identical and opt.state[net[0].weight]["step"].item() == 1

# %%
%%repro --no-restore-rng
loss = F.mse_loss(net(xb), yb)
opt.zero_grad()
loss.backward()
opt.step()

# %%
first = _repro.first
print(_repro.cause, "|", first.op, "in", first.module, "at line", first.lineno, "|", first.phase)
assert _repro.cause == "rng" and first.op == "aten.bernoulli_.float" and first.module == "net.2"

# %% [markdown]
# The dropout op (`aten.bernoulli_`, module `net.2`, line 1 of the cell) drew a different mask. A value
# from Python that the previous run changed is `external` — here a list the cell appends to, which the
# snapshot cannot restore (it is not torch state):

# %%
history = []

# %%
%%repro
history.append(1)
scale = 1.0 + 0.1 * len(history)
out = net[0](xb) * scale

# %%
assert _repro.cause == "external" and _repro.first.lineno == 3
print(_repro.first.input)

# %% [markdown]
# On a GPU, the `index_add_` of section 2 is the classic `nondeterministic_op`: same inputs, a
# different sum in the last bits. The report lists the ops PyTorch documents as nondeterministic on
# the device, and a preflight of the settings (deterministic flag, `CUBLAS_WORKSPACE_CONFIG`, TF32,
# cuDNN benchmark, DataLoaders with unseeded workers). On a CPU the cell is identical:

# %%
%%repro
table = scatter_rows(device)

# %%
assert _repro.cause in (None, "nondeterministic_op")
print([(use.op, use.device, use.count) for use in _repro.nondeterministic_ops])

# %% [markdown]
# The Python twin takes a function and the state it changes, and returns the same report:

# %%
import torch_nbdebug

def train_step():
    loss = F.mse_loss(net(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()

report = torch_nbdebug.repro(train_step, state=(net, opt))
print(report.identical, report.cause)
assert report.identical

# %% [markdown]
# ## Summary
#
# * Seed **every** generator (`random`, NumPy, `torch`, the `DataLoader`'s), and change one thing at
#   a time.
# * Same seed ≠ same numbers on a GPU: atomics reorder float additions. `use_deterministic_algorithms`
#   plus the cuDNN flags and `CUBLAS_WORKSPACE_CONFIG` make runs repeat — to debug, not by default.
# * `log`, division and `sqrt` need an epsilon or a clamp near zero, chosen for the dtype — and
#   prefer the fused, stable functions (`log_softmax`, `cross_entropy`, `*_with_logits`).
# * float16 overflows above 65 504 and underflows below ~6e-8: use bfloat16, or `GradScaler`, and
#   read its scale: a few early skips are calibration, a collapsing scale is a bug.
# * When two runs differ, `%%repro` names the first op that differs, its line and the cause (`rng`,
#   `uninitialized`, `external`, `nondeterministic_op`), with the fix.
# %% [markdown]
# ## Exercise: same seed, different result
#
# A training function that seeds torch first, then trains three steps on augmented data. Called
# twice it gives two different losses. Find which value differs between runs (hint: one step under
# `%%repro --no-restore-rng`, with the model and optimizer in the namespace), and fix `augment` so
# that `torch.manual_seed(0)` alone makes `train()` repeat exactly.

# %% tags=["raises-exception"]
def augment(batch):
    return batch * (1 + 0.1 * random.random())  # random brightness


def train(steps: int = 3) -> float:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(augment(torch.ones(8, 4))).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


first, second = train(), train()
print(first, second)
assert first == second, "same seed, different result"

# %% [markdown]
# <details><summary>Solution</summary>
#
# `%%repro --no-restore-rng` on one training step reports cause `external`: the first op whose output
# differs is the `aten.mul` on the `augment` line, and its other input came from outside torch —
# Python's `random`, which `torch.manual_seed` does not seed. Draw the random number from torch's
# generator (or seed `random` too, or pass a `torch.Generator` to `augment`):
#
# ```python
# def augment(batch):
#     return batch * (1 + 0.1 * torch.rand(()))  # torch's generator: torch.manual_seed covers it
#
#
# first, second = train(), train()
# assert first == second
# ```
#
# </details>
