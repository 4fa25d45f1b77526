# %% [markdown]
# # 09 · Finding what makes a training step slow
#
# A step takes 60 ms and you expected 5. Is it the model? The data? Python? `torch.profiler` gives a
# table of hundreds of ops or a trace to open in Perfetto, and still leaves the question open:
# *which line of mine* do I change?
#
# **`%%profile`** (torch_nbdebug) runs the cell under `torch.profiler` and answers with a **verdict** —
# `data`, `host`, `launch`, `sync`, `compute`, `memory` or `balanced` — its share of the step, the
# figures behind it, the fix, and the **statement** and **module** to look at. Each step's time is cut
# into data loading, forward, backward, optimizer, host syncs and Python outside torch ops, adding up to
# the step. Steps are the optimizer's steps; the first is left out as warm-up.
#
# This notebook speeds up one training loop three times over, following the verdicts.

# %%
import torch
import torch.nn as nn
import torch.nn.functional as F

%load_ext torch_nbdebug

torch.manual_seed(0)
torch.set_num_threads(1)  # steady timings on a shared machine
T, D = 64, 16              # time steps per sample, features per step

# The "files": one text record per sample, as a CSV export would give them.
records = [",".join(f"{v:.4f}" for v in torch.randn(T * D).tolist()) for _ in range(512)]
targets = torch.randn(512, 1)


class Records(torch.utils.data.Dataset):
    """Parses and normalizes a record every time a sample is asked for."""

    def __len__(self):
        return len(records)

    def __getitem__(self, i):
        values = [float(v.strip()) for v in records[i].split(",")]  # parse the text
        mean = sum(values) / len(values)
        values = [(v - mean) / 2.0 for v in values]        # normalize, in Python
        return torch.tensor(values).view(T, D), targets[i]


class Smoother(nn.Module):
    """An exponential moving average over time of a projection, then a read-out."""

    def __init__(self, decay=0.9):
        super().__init__()
        self.proj, self.head, self.decay = nn.Linear(D, D), nn.Linear(D, 1), decay

    def forward(self, x):                   # x: (batch, T, D)
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):         # one small step per time step
            h = self.decay * h + self.proj(x[:, t])
        return self.head(torch.tanh(h))


def train(model, batches, steps=8):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (xb, yb) in zip(range(steps), batches):
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()

# %% [markdown]
# ## 1. The first profile: the step waits for data
#
# `-o` returns the report (it is also kept as `_profile`). Read the verdict, then the table of lines:
# the slowest statements of *your* code, in your `Dataset` too, never a library frame.

# %%
%%profile -o
model = Smoother()
train(model, torch.utils.data.DataLoader(Records(), batch_size=64))

# %%
first = _profile
print(first.verdict.kind, f"{first.verdict.share:.0%}", "->", first.verdict.line)
assert first.verdict.kind == "data" and first.verdict.line.function == "__getitem__"

# %% [markdown]
# Most of each step waits in `Records.__getitem__`, and the report names its slowest line (parsing the
# text, or turning a list of Python floats into a tensor: the table of lines has both). The fix it
# suggests: do the work in background workers (`num_workers`), or **cache** what never changes.
# Records never change, so parse them once:

# %%
parsed = torch.stack([Records()[i][0] for i in range(len(records))])
cached = torch.utils.data.TensorDataset(parsed, targets)

# %%
%%profile -o
model = Smoother()
train(model, torch.utils.data.DataLoader(cached, batch_size=64))

# %%
second = _profile
print(second.verdict.summary)
assert second.verdict.kind == "launch"

# %% [markdown]
# ## 2. Many small ops: the loop over time
#
# Now the step is **launch-bound**: hundreds of tiny ops per step (each a few microseconds), most of
# them from one statement, the `for` loop's body in `Smoother.forward`, in module `model`. On a GPU
# every one of them is a kernel launch. The fix: do the whole sequence in a few big ops. An exponential
# moving average is a weighted sum: `h_T = sum_t decay^(T-1-t) * proj(x_t)`.

# %%
class FastSmoother(Smoother):
    def forward(self, x):
        weights = self.decay ** torch.arange(x.shape[1] - 1, -1, -1, dtype=x.dtype)
        h = (self.proj(x) * weights[None, :, None]).sum(1)  # all time steps at once
        return self.head(torch.tanh(h))


slow, fast = Smoother(), FastSmoother()
fast.load_state_dict(slow.state_dict())
torch.testing.assert_close(fast(parsed[:4]), slow(parsed[:4]))  # the same model, just vectorized
ready = [(parsed[i:i + 64], targets[i:i + 64]) for i in range(0, 512, 64)]  # batches made once

# %%
%%profile -o
model = FastSmoother()
train(model, ready)

# %%
third = _profile
third.compare(first)

# %%
change = third.compare(first)
print(f"{change.speedup:.0f}x faster; verdict {change.before_verdict} -> {change.after_verdict}")
assert change.speedup > 5 and change.verdict_changed

# %% [markdown]
# `compare` lists which categories, modules and lines got faster (or slower) and whether the verdict
# changed. What is left of a sub-millisecond step on a CPU is mostly the Python around the ops
# (`loss.backward()`, `opt.step()`): at this size there is nothing more worth fixing. In a live notebook the widget's timeline of one step zooms (drag across it) and a row of the
# lines table opens its line with the code around it.
#
# ## 3. The Python twin
#
# In a script or a function: `with torch_nbdebug.profile() as prof:`; the report is the same object.
# `prof.breakdown` has each step's time by category (adding up to the step), `prof.by_module` and
# `prof.by_line` the rows of the tables, `prof.to_json()` a small summary to keep (not the trace:
# `trace="step.json"` writes that, for Perfetto).

# %%
import torch_nbdebug

with torch_nbdebug.profile() as prof:
    train(FastSmoother(), ready)

step = prof.breakdown[0]
print(f"step {step.number}: {step.ms:.2f} ms =", " + ".join(f"{c} {v:.2f}" for c, v in step.categories.items()))
print("modules:", [m.path for m in prof.by_module])
print(f"summary JSON: {len(prof.to_json()) / 1024:.0f} KB")
assert abs(sum(step.categories.values()) - step.ms) < 1e-6

# %% [markdown]
# ## Exercise
#
# The loop below logs a running statistic at every step and has become slow. Put `%%profile` on top
# of the cell: what is the verdict, and which line does it name? Fix the cell so that the verdict is no
# longer about that line, while still logging one number per step.

# %%
def train_logged(model, batches, steps=8):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = []
    for step, (xb, yb) in zip(range(steps), batches):
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        log.append(sorted(float(v) for v in model(xb).detach().flatten().tolist() * 2000)[0])
    return log


train_logged(FastSmoother(), ready)

# %% [markdown]
# <details><summary>Solution</summary>
#
# `%%profile` says **host**: most of the step is Python outside torch ops, at the `log.append(sorted(...))`
# line — it converts every prediction to a Python float and sorts 128,000 of them to find a minimum.
# Ask torch for the minimum instead (one op, no Python loop); the step gets many times shorter, and
# what is left is the Python around the ops of a sub-millisecond step:
#
# ```python
# %%profile -o
# def train_logged(model, batches, steps=8):
#     opt = torch.optim.SGD(model.parameters(), lr=0.01)
#     log = []
#     for step, (xb, yb) in zip(range(steps), batches):
#         opt.zero_grad()
#         loss = F.mse_loss(model(xb), yb)
#         loss.backward()
#         opt.step()
#         log.append(model(xb).detach().min())
#     return log
#
#
# train_logged(FastSmoother(), ready)
# ```
#
# ```python
# slowest = _profile.by_line[0].text
# assert "sorted(" not in slowest and "sorted(" not in str(_profile.verdict.line), slowest
# ```
# </details>
