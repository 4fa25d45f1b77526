# %% [markdown]
# # 07 · Code that debugs itself
#
# The cheapest bug to fix is the one your code reports itself, at the line where it happens, with a
# message that says what was expected. This notebook collects the habits that make PyTorch code do
# that:
#
# 1. **Shape and value assertions in `forward`** — fail at the layer that got the wrong tensor.
# 2. **`torch.testing.assert_close`** — compare your implementation to a reference, with tolerances
#    that fit the dtype.
# 3. **`torch.autograd.gradcheck`** — prove that a custom `autograd.Function`'s backward is right.
# 4. **Structured logging** — losses, gradient norms and memory as data you can query, so a bad
#    step is found by code, not by squinting at a progress bar.

# %%
import io
import json
import logging

import matplotlib
import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
print("torch", torch.__version__)

# %% [markdown]
# ## 1. Shape and value assertions in `forward`
#
# Broadcasting is PyTorch's most helpful and most dangerous feature: a `(B, 1)` tensor minus a
# `(B,)` tensor is silently `(B, B)`. A wrong shape often raises *nowhere* — it just trains badly.
# State the shapes you expect where tensors enter a module, with names for the dimensions, and the
# error appears at the right layer with a message a colleague can read.

# %%
def expect_shape(tensor: torch.Tensor, spec: str, dims: dict) -> None:
    """Check `tensor` against a spec like "B T D"; bind unknown letters in `dims`, check known ones."""
    names = spec.split()
    if tensor.dim() != len(names):
        raise ValueError(f"expected {len(names)} dims ({spec}), got shape {tuple(tensor.shape)}")
    for name, size in zip(names, tensor.shape):
        if dims.setdefault(name, size) != size:
            raise ValueError(f"dimension {name} of ({spec}) is {size}, expected {dims[name]} "
                             f"(shape {tuple(tensor.shape)}, known sizes {dims})")


class CheckedAttentionPool(nn.Module):
    """Pools a sequence (B, T, D) into (B, D) with learned attention weights over T."""

    def __init__(self, d: int, check_values: bool = True):
        super().__init__()
        self.score = nn.Linear(d, 1)
        self.d = d
        self.check_values = check_values

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        dims = {"D": self.d}
        expect_shape(x, "B T D", dims)
        expect_shape(mask, "B T", dims)
        scores = self.score(x).squeeze(-1).masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        if self.check_values:  # costs a device->host sync on GPU: keep it behind a flag
            assert torch.isfinite(weights).all(), "attention weights not finite: a row fully masked?"
        out = (weights.unsqueeze(-1) * x).sum(dim=1)
        expect_shape(out, "B D", dims)
        return out


pool = CheckedAttentionPool(d=8)
x = torch.randn(4, 6, 8)
mask = torch.ones(4, 6, dtype=torch.bool)
print("good input ->", tuple(pool(x, mask).shape))

problems = {
    "time and features swapped": lambda: pool(x.transpose(1, 2), mask),
    "mask for a different length": lambda: pool(x, mask[:, :5]),
    "a sequence with every step masked": lambda: pool(x, mask.clone().index_fill_(0, torch.tensor([2]), False)),
}
caught = {}
for name, call in problems.items():
    try:
        call()
    except (ValueError, AssertionError) as err:
        caught[name] = f"{type(err).__name__}: {err}"
for name, message in caught.items():
    print(f"- {name}:\n    {message}")
assert len(caught) == len(problems)

# %% [markdown]
# Notes on doing this well:
#
# * **Name the dimensions** in the message (`B T D`): "dimension D is 6, expected 8" is a diagnosis;
#   "assertion failed" is not.
# * **Shape checks are free** (shapes live on the CPU). **Value checks are not**: `torch.isfinite(w).all()`
#   on a GPU tensor must wait for the GPU to answer (a synchronisation), so keep them behind a flag
#   you turn on while debugging.
# * Python's `assert` disappears under `python -O`. For checks that must survive, raise an
#   exception; `torch._assert(cond, msg)` is the variant that also survives `torch.fx` tracing and
#   `torch.compile`.

# %% [markdown]
# ## 2. `torch.testing.assert_close`: is my implementation right?
#
# When you rewrite an operation — for speed, for a custom kernel, or to understand it — compare it to
# a reference on random inputs. `==` is the wrong test for floating point (notebook 06 shows why
# summation order changes the last bits); `torch.testing.assert_close` compares with a relative and
# an absolute tolerance chosen by dtype (float32: `rtol=1.3e-6, atol=1e-5`; float16: `rtol=1e-3,
# atol=1e-5`) and, when it fails, says how many elements differ and by how much.

# %%
def my_layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)  # layer norm uses the biased variance
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def my_layer_norm_buggy(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True)  # bug: unbiased (divides by n - 1)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


x = torch.randn(16, 32)
weight, bias = torch.randn(32), torch.randn(32)
reference = F.layer_norm(x, (32,), weight, bias)

torch.testing.assert_close(my_layer_norm(x, weight, bias), reference)
print("my_layer_norm matches F.layer_norm")

try:
    torch.testing.assert_close(my_layer_norm_buggy(x, weight, bias), reference)
except AssertionError as err:
    failure = str(err)
print("\nthe buggy version:\n" + failure)
assert "Mismatched elements" in failure

# %% [markdown]
# The failure message is the debugging information: how many elements mismatch, the greatest
# absolute and relative difference, and where. Here **all** 512 elements mismatch: a systematic
# error, not rounding noise (rounding gives a few elements off by tiny amounts). Dividing by `n - 1`
# instead of `n` scales every normalised value by `sqrt(31/32)`, about 1.6 % — small enough to
# train "fine" and to go unnoticed without this test. (The greatest *relative* difference is large
# only where the bias makes the reference close to zero.)
#
# Lower precision needs looser tolerances: compare a float16 result to a float32 reference with the
# float16 defaults (pass `rtol`/`atol` explicitly), and never loosen a float32 tolerance until a test
# passes — that hides real bugs.

# %%
half_result = my_layer_norm(x.half(), weight.half(), bias.half()).float()
try:
    torch.testing.assert_close(half_result, reference)  # float32 tolerances: too strict for fp16
except AssertionError:
    print("float16 vs float32 with float32 tolerances: fails, as it should")
torch.testing.assert_close(half_result, reference, rtol=1e-2, atol=1e-2)
print("float16 vs float32 with float16-sized tolerances: passes")

# %% [markdown]
# ## 3. `gradcheck`: is my backward right?
#
# A custom `torch.autograd.Function` has a hand-written `backward`. If it is wrong, nothing raises:
# the model trains worse, or not at all. `torch.autograd.gradcheck` compares your analytical
# gradient with a numerical one (finite differences, `(f(x+ε) − f(x−ε)) / 2ε`) for every input
# element. Use **float64** inputs — in float32 the finite differences are too noisy to compare.
#
# Our example: `log(cosh(x))`, a smooth version of `|x|` used as a robust loss. Computed naively,
# `cosh` overflows for |x| > 89 in float32, so we write a stable forward
# (`|x| + log1p(exp(-2|x|)) - log 2`) and its derivative `tanh(x)` by hand.

# %%
import math

from torch.autograd.gradcheck import GradcheckError


class LogCosh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.abs() + torch.log1p(torch.exp(-2 * x.abs())) - math.log(2.0)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return grad_out * torch.tanh(x)


class LogCoshBuggy(LogCosh):
    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return torch.tanh(x)  # bug: forgot the chain rule (grad_out *)


inputs = torch.randn(6, dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradcheck(LogCosh.apply, (inputs,))
print("LogCosh: gradcheck passes")

try:
    torch.autograd.gradcheck(LogCoshBuggy.apply, (inputs,))
except GradcheckError as err:
    message = str(err)
print("\nLogCoshBuggy:", message)
assert "Jacobian mismatch" in message

big = torch.tensor([-200.0, 0.0, 200.0], requires_grad=True)
print("\nstable forward at ±200 in float32:", LogCosh.apply(big).detach(),
      " naive log(cosh(x)):", torch.log(torch.cosh(big)).detach())

# %% [markdown]
# The buggy backward returns gradients of the right shape, never raises, and in a plain
# `f(x).sum().backward()` (where `grad_out` is all ones) even gives the right numbers — it would
# pass a quick test and then train badly inside a network. `gradcheck` probes each output separately
# (a one-hot `grad_out`) and prints both Jacobians: the numerical one is diagonal (each output
# depends only on its own input), while the analytical one has no zeros at all — whichever output
# is probed, the backward returns the full `tanh(x)`. It ignores the gradient it is handed, which
# points straight at the missing `grad_out *`.
# Also worth knowing:
#
# * `torch.autograd.gradgradcheck` does the same for second derivatives (needed for gradient
#   penalties or meta-learning).
# * Test at the points that matter: zero, large values, ties (`|x|` at 0 has no derivative, and
#   gradcheck will say so).
# * Notebook *03 · Seeing the graph* shows where a custom Function's backward sits in the autograd
#   graph.

# %% [markdown]
# ## 4. Structured logging: losses, gradient norms and memory as data
#
# `print(f"step {i} loss {loss}")` produces text you read once. Log **records** instead — one JSON
# object per step with the loss, the total gradient norm, per-layer gradient norms, the learning
# rate and memory — and problems become queries: "which step's gradient norm was 10× the median?"
#
# Three details make such logs cheap and correct:
#
# * `loss.item()`, not `loss`: storing the tensor keeps its whole autograd graph alive (the memory
#   leak of notebook *05 · Memory*).
# * `clip_grad_norm_` already **returns** the total norm before clipping — log it; with
#   `max_norm=inf` it measures without clipping.
# * Memory: on a GPU, `torch.cuda.memory_allocated()` and `max_memory_allocated()`; on a CPU, count
#   the bytes of parameters, gradients and optimizer state (what we do here, so it runs anywhere).
#
# A small regression model, with one corrupted batch at step 30 (its targets in the wrong units,
# ×100, as a broken preprocessing step would produce):

# %%
log_stream = io.StringIO()
logger = logging.getLogger("train")
logger.handlers[:] = [logging.StreamHandler(log_stream)]
logger.setLevel(logging.INFO)
logger.propagate = False


def tensor_bytes(model, optimizer) -> dict:
    """Bytes held by parameters, gradients and optimizer state (what a CPU run can count exactly)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                for v in s.values() if torch.is_tensor(v))
    return {"params": params, "grads": grads, "optimizer_state": state}


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
true_w = torch.randn(10, 1)
BAD_STEP = 30

for step in range(60):
    x = torch.randn(32, 10)
    y = x @ true_w
    if step == BAD_STEP:
        y = y * 100
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    layer_norms = {name: p.grad.norm().item() for name, p in model.named_parameters() if name.endswith("weight")}
    total_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
    optimizer.step()
    record = {"step": step, "loss": loss.item(), "grad_norm": total_norm.item(),
              "layer_grad_norms": layer_norms, "lr": optimizer.param_groups[0]["lr"],
              "memory": tensor_bytes(model, optimizer)}
    if torch.cuda.is_available():
        record["cuda_allocated"] = torch.cuda.memory_allocated()
    logger.info(json.dumps(record))

records = [json.loads(line) for line in log_stream.getvalue().splitlines()]
print(len(records), "records; the first:\n", json.dumps(records[0], indent=1))

# %% [markdown]
# Now the log is data. Find the steps whose gradient norm is far above the typical one (median, not
# mean, so the outlier does not hide itself), and which layer took the hit:

# %%
norms = torch.tensor([r["grad_norm"] for r in records])
median = norms.median().item()
spikes = [r for r in records if r["grad_norm"] > 10 * median]  # 10x: far outside normal noise
for r in spikes:
    worst = max(r["layer_grad_norms"], key=r["layer_grad_norms"].get)
    print(f"step {r['step']}: grad norm {r['grad_norm']:.2f} = {r['grad_norm'] / median:.0f}x the median "
          f"({median:.3f}); largest in {worst}; loss {r['loss']:.1f}")
assert [r["step"] for r in spikes] == [BAD_STEP]
memory = records[-1]["memory"]
n_tensors = len(list(model.parameters()))
# Adam: exp_avg and exp_avg_sq the size of each parameter, plus a float32 step counter per parameter
assert memory["optimizer_state"] == 2 * memory["params"] + 4 * n_tensors, memory

# %%
matplotlib.rcParams["figure.dpi"] = 72
fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(9, 2.8))
steps = [r["step"] for r in records]
ax_loss.semilogy(steps, [r["loss"] for r in records])
ax_loss.set(title="loss", xlabel="step")
ax_norm.semilogy(steps, norms.tolist(), label="total")
for name in records[0]["layer_grad_norms"]:
    ax_norm.semilogy(steps, [r["layer_grad_norms"][name] for r in records], lw=0.8, label=name)
ax_norm.axvline(BAD_STEP, color="red", ls=":", label="bad batch")
ax_norm.set(title="gradient norms", xlabel="step")
ax_norm.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# Adam's state is twice the parameter bytes (an `exp_avg` and an `exp_avg_sq` per parameter) plus
# a 4-byte step counter per parameter tensor — the kind of fact a memory log confirms at a glance,
# and the assertion above checks.
#
# From here, the natural next steps are automatic: skip or clip a step whose gradient norm is a
# spike, stop a run whose loss is non-finite, or alert on a memory curve that only grows.
# For per-layer gradient statistics over a training loop, with histograms and flags, see
# *04 · Watching gradients* (`%%grads`); for memory by category, *05 · Memory* (`%%cudamem`).
#
# ## Summary
#
# * Assert shapes with named dimensions at module boundaries; keep value checks behind a flag.
# * Compare implementations with `torch.testing.assert_close` and dtype-appropriate tolerances.
# * `gradcheck` every custom `backward`, in float64, at the points that matter.
# * Log records, not strings: `loss.item()`, the norm `clip_grad_norm_` returns, memory — then let
#   code find the bad step.
# %% [markdown]
# ## Exercise: a custom backward that forgets something
#
# `softplus(x) = log(1 + eˣ)` as an `autograd.Function`, whose derivative is `sigmoid(x)`. The
# formula is right, yet `gradcheck` fails. Read its message (compare the numerical and the analytical
# Jacobian: where do they differ?) and fix `backward`.

# %% tags=["raises-exception"]
class Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.softplus(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return torch.sigmoid(x)  # d/dx log(1 + e^x)


points = torch.randn(5, dtype=torch.float64, requires_grad=True)
torch.autograd.gradcheck(Softplus.apply, (points,))

# %% [markdown]
# <details><summary>Solution</summary>
#
# The numerical Jacobian is diagonal (each output depends on its own input); the analytical one has
# the same row everywhere: `backward` ignored `grad_out`. `backward` receives the gradient of the
# loss with respect to the output and must return the gradient with respect to the input — the
# chain rule multiplies the two. With `grad_out` all ones (a plain `.sum().backward()`) the bug is
# invisible, which is why `gradcheck` probes one output at a time.
#
# ```python
# class Softplus(torch.autograd.Function):
#     @staticmethod
#     def forward(ctx, x):
#         ctx.save_for_backward(x)
#         return F.softplus(x)
#
#     @staticmethod
#     def backward(ctx, grad_out):
#         (x,) = ctx.saved_tensors
#         return grad_out * torch.sigmoid(x)
#
#
# assert torch.autograd.gradcheck(Softplus.apply, (points,))
# ```
#
# </details>
