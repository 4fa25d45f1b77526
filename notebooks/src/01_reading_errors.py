# %% [markdown]
# # 01 · Reading PyTorch errors
#
# Most debugging sessions start with a wall of red text. This notebook teaches you to read it:
#
# 1. **Anatomy of a stack trace** — which line is the error, which line is *yours*, and what the
#    message is telling you.
# 2. **A gallery of the everyday errors** — shapes, dtypes, devices, targets — and the one fact each
#    message gives you.
# 3. **The CUDA device-side assert** — why GPU errors point at the wrong line, what
#    `CUDA_LAUNCH_BLOCKING=1` does, and the CPU run that gives you the precise error anywhere.
# 4. **Post-mortem debugging** — `%debug` / `pdb`: walk into the frame that failed and look at the
#    shapes, dtypes and devices of the tensors that were really there.
# 5. **`%explain`** — let `torch_nbdebug` do that reading for you: which layer, which line, which
#    operands, and — for the autograd errors whose messages name no line at all — the culprit.
#
# Everything here runs on a CPU in a few seconds. Cells that fail on purpose are tagged
# `raises-exception`, so the notebook still runs top to bottom (and in CI).

# %%
import io
import sys
import traceback

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

torch.manual_seed(0)
print("torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## 1. Anatomy of a stack trace
#
# Here is a small classifier with a bug that everyone writes once: the first `Linear` expects
# 10 features, but the data has 12. Run the next cell and look at the error **before** reading on.

# %%
class Classifier(nn.Module):
    def __init__(self, n_in: int = 10, n_hidden: int = 16, n_classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, n_hidden), nn.ReLU())
        self.head = nn.Linear(n_hidden, n_classes)

    def forward(self, x):
        h = self.body(x)
        return self.head(h)


model = Classifier()
batch = torch.randn(4, 12)  # 12 features: the data changed, the model did not

# %% tags=["raises-exception"]
logits = model(batch)

# %% [markdown]
# ### How to read it — bottom up
#
# A Python traceback is printed **outermost call first, failing call last**. So read it from the
# bottom:
#
# 1. **The last line is the error**: its type (`RuntimeError`) and the message. PyTorch messages are
#    precise — `mat1 and mat2 shapes cannot be multiplied (4x12 and 10x16)` says: a matrix
#    multiplication got a `4×12` input and a `10×16` weight (stored transposed, `out × in = 16×10`).
#    The inner dimensions, 12 and 10, must match.
# 2. **Walk up to the first frame that is your code.** The frames just above the message are inside
#    `torch/nn/modules/...` (`linear.py`, `container.py`, `module.py`'s `_call_impl`). The library is
#    almost never the bug: it is reporting what you handed it.
# 3. **The innermost frame in your code is where to look**: here `h = self.body(x)` in `forward`,
#    called from the cell line `logits = model(batch)`.
#
# The same reading can be done by code, which is also how tools like `torch_nbdebug` find "your line":
# walk the traceback's frames and keep those whose file is not inside the torch package.

# %%
def user_frames(tb):
    """The frames of a traceback that are not inside torch's own source tree."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    return [f for f in traceback.extract_tb(tb) if not f.filename.startswith(torch_dir)]


try:
    model(batch)
except RuntimeError as err:
    error = err
    frames = traceback.extract_tb(err.__traceback__)

print(f"{len(frames)} frames in the traceback; the error: {type(error).__name__}: {error}\n")
for frame in frames:
    mine = "  <-- your code" if frame in user_frames(error.__traceback__) else ""
    print(f"{frame.filename.split('/')[-1]:>18}:{frame.lineno:<5} {frame.line}{mine}")

innermost_user = user_frames(error.__traceback__)[-1]
assert innermost_user.line == "h = self.body(x)", innermost_user
assert "4x12 and 10x16" in str(error)

# %% [markdown]
# The same traceback as a picture: one bar per frame, outermost call at the top, the error at the
# bottom. Reading starts at the red bar and climbs to the first blue one — the innermost frame of
# yours:

# %%
def draw_traceback(frames, mine, error):
    """One bar per frame (yours blue, the library's grey), the error in red at the bottom."""
    fig, ax = plt.subplots(figsize=(9, 0.36 * len(frames) + 1.1), dpi=72)
    for depth, frame in enumerate(frames):
        yours = frame in mine
        y = len(frames) - depth
        ax.barh(y, 1, height=0.85, color="#2f6fb0" if yours else "#e6e6e6")
        file = "cell" if "ipykernel_" in frame.filename else frame.filename.split("/")[-1]
        where = f"{file}:{frame.lineno}"
        ax.text(0.01, y, f"{where:<20}{frame.line[:64]}", va="center", family="monospace", fontsize=9,
                color="white" if yours else "#333333")
    ax.barh(0, 1, height=0.85, color="#c0392b")
    ax.text(0.01, 0, f"{type(error).__name__}: {error}"[:84], va="center", family="monospace",
            fontsize=9, color="white")
    innermost = len(frames) - frames.index(mine[-1])
    ax.annotate("", xy=(1.03, innermost), xytext=(1.03, 0), annotation_clip=False,
                arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.text(1.05, 0, "1. the error", va="center", fontsize=9)
    ax.text(1.05, innermost, "2. your innermost line", va="center", fontsize=9)
    ax.text(1.05, len(frames), "outermost call", va="center", fontsize=9, color="#777777")
    ax.set_xlim(0, 1)
    ax.set_axis_off()
    ax.set_title("A traceback, read bottom up", loc="left")
    fig.tight_layout()
    plt.show()


draw_traceback(frames, user_frames(error.__traceback__), error)

# %% [markdown]
# The fix follows from the message: either the model takes 12 features (`Classifier(n_in=12)`) or
# the data pipeline should produce 10. Which one is right is a question about your data, not about
# PyTorch.

# %% [markdown]
# ## 2. A gallery of everyday errors
#
# Each of these is one line of code and one kind of mistake. The useful part of each message is
# highlighted by the comment next to it. We catch each error so that all of them print in one cell.

# %%
embedding = nn.Embedding(10, 4)
cases = {
    # the last dimension of x and the weight's in_features disagree
    "shape mismatch": lambda: nn.Linear(10, 2)(torch.randn(3, 12)),
    # a float64 numpy array became a double tensor; the weights are float32
    "dtype mismatch": lambda: nn.Linear(3, 2)(torch.zeros(1, 3, dtype=torch.float64)),
    # class labels must be integer class indices (Long), not floats
    "target dtype": lambda: nn.CrossEntropyLoss()(torch.zeros(2, 3), torch.tensor([0.0, 1.0])),
    # a label 5 with only 3 classes — the CPU tells you the value
    "target out of range": lambda: nn.CrossEntropyLoss()(torch.zeros(2, 3), torch.tensor([0, 5])),
    # a token id >= vocabulary size
    "index out of range": lambda: embedding(torch.tensor([1, 10])),
    # view() needs the element count to match; reshape() would fail the same way here
    "bad view": lambda: torch.zeros(5).view(2, 3),
    # tensors on two devices (a 'meta' tensor plays the GPU here, so this runs anywhere)
    "device mismatch": lambda: torch.ones(2, device="meta") + torch.ones(2),
}
messages = {}
for name, case in cases.items():
    try:
        case()
    except (RuntimeError, IndexError) as err:
        messages[name] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    else:
        messages[name] = "no error?!"
for name, message in messages.items():
    print(f"{name:>20} | {message}")
assert "no error?!" not in messages.values()

# %% [markdown]
# Habits that make these messages easy:
#
# * **Print shapes, dtypes and devices at the boundary** where data enters the model
#   (`x.shape, x.dtype, x.device`) — most of the gallery is caught there.
# * **Trust the numbers in the message.** `(4x12 and 10x16)` tells you the batch size, the feature
#   count and the layer's `in_features`; `Target 5 is out of bounds` tells you the bad label.
# * **Errors in `loss.backward()`** point at the `backward()` line, not at the forward operation that
#   caused them. `torch.autograd.set_detect_anomaly(True)` adds the forward traceback; notebook
#   *02 · Hunting NaNs* shows it, and where `%%nanwatch` does better.

# %% [markdown]
# ## 3. The CUDA device-side assert, and why CUDA errors arrive late
#
# On a GPU, the `index out of range` above does **not** look like that. You get
#
# ```
# RuntimeError: CUDA error: device-side assert triggered
# CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace
# below might be incorrect.
# For debugging consider passing CUDA_LAUNCH_BLOCKING=1
# ```
#
# and the traceback points at some *later* line — often `loss.item()` or `print(loss)`.
#
# **Why.** Python does not run GPU kernels; it *queues* them. `embedding(tokens)` returns as soon as
# the kernel is enqueued, and Python carries on queueing the next operations. When the kernel finally
# runs and a thread hits `assert(index < num_embeddings)`, Python is already elsewhere. The error is
# only noticed at the next point where the CPU waits for the GPU (a *synchronisation*: `.item()`,
# `.cpu()`, `print(tensor)`, `torch.cuda.synchronize()`), and that is the line the traceback shows.
# Worse, after a device-side assert the CUDA context is broken: every later CUDA call fails too, and
# you must **restart the kernel**.
#
# **What to do.**
#
# 1. *Reproduce on the CPU.* Move the model and one failing batch to `"cpu"` and run it again: CPU
#    kernels run synchronously and check indices with a clear message (below). This is the fastest
#    route and it works on any laptop.
# 2. *Or make CUDA synchronous:* set `CUDA_LAUNCH_BLOCKING=1` **before CUDA initialises** (first
#    line of the notebook, or `CUDA_LAUNCH_BLOCKING=1 python train.py`). Each kernel then finishes
#    before Python continues, so the traceback points at the right line. It is slow; use it only
#    to find the line.
# 3. *Then prevent it:* validate indices where they are produced (tokenizer, label encoding).
#
# The CPU equivalent: a language-model batch with a token id equal to the vocabulary size (a classic
# off-by-one after adding a special token to the tokenizer but not to the embedding).

# %%
vocab_size = 100
lm_embedding = nn.Embedding(vocab_size, 8)
tokens = torch.randint(0, vocab_size, (2, 6))
tokens[1, 4] = vocab_size  # the new <eos> token got id 100, but the table has rows 0..99

# %% tags=["raises-exception"]
hidden = lm_embedding(tokens)

# %% [markdown]
# On the CPU the message names the problem (`index out of range in self`) and the traceback points at
# the right line. Now find the offending position, the check you would put in your data pipeline:

# %%
bad = (tokens < 0) | (tokens >= lm_embedding.num_embeddings)
positions = bad.nonzero().tolist()
print("token ids out of range at (batch, position):", positions, "values:", tokens[bad].tolist())
assert positions == [[1, 4]]

# %% [markdown]
# If a GPU is present, the next cell shows the asynchronous report for real. It runs in a
# **separate process**, because a device-side assert ruins the CUDA context of the process it
# happens in — it would break this notebook's kernel. It runs the same script twice, without and with
# `CUDA_LAUNCH_BLOCKING=1`, and prints the line each traceback blames. On a machine without CUDA it
# says so and does nothing.

# %%
import os
import subprocess

SCRIPT = """
import torch
emb = torch.nn.Embedding(100, 8).cuda()
tokens = torch.tensor([[1, 2, 100]], device="cuda")
hidden = emb(tokens)              # line 5: the real culprit
loss = hidden.sum() * 2           # line 6
print("loss", loss.item())        # line 7: the first synchronisation
"""


def blamed_line(blocking: bool) -> str:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1" if blocking else "0")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    lines = [line.strip() for line in run.stderr.splitlines() if 'File "<string>"' in line]
    return lines[-1] if lines else run.stderr.strip().splitlines()[-1]


if torch.cuda.is_available():
    print("without CUDA_LAUNCH_BLOCKING:", blamed_line(False))
    print("with    CUDA_LAUNCH_BLOCKING:", blamed_line(True))
else:
    print("No CUDA device here: the CPU run above is the precise version of this error.")

# %% [markdown]
# ## 4. Post-mortem: `%debug` and `pdb`
#
# A traceback tells you *where*; to know *what* — the shapes, dtypes and devices that were really
# there — step into the failed frame. In a notebook, right after a cell fails, run `%debug` in a new
# cell: IPython opens `pdb` **at the frame that raised**, with all its local variables alive. The
# commands you need:
#
# | command | does |
# |---|---|
# | `where` (`w`) | print the stack, `>` marks the current frame |
# | `up` (`u`) / `down` (`d`) | move to the caller / callee frame |
# | `p x.shape, x.dtype, x.device` | print an expression in the current frame |
# | `pp {k: v.shape for k, v in locals().items() if torch.is_tensor(v)}` | every tensor's shape |
# | `list` (`l`) | the source around the current line |
# | `quit` (`q`) | leave the debugger |
#
# (`%pdb on` makes IPython open the debugger automatically on every error.)
#
# `%debug` waits for you to type, so it cannot run unattended in this notebook's CI. What it does is
# simple, though, and we can do exactly the same thing with the commands written in advance: after a
# cell fails, IPython keeps the traceback in `sys.last_traceback`; `%debug` hands it to the debugger.
# First, a failure deep inside a model — attention scores computed with the wrong transpose:

# %%
class TinyAttention(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):  # x: (batch, time, d)
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(0, 1)  # bug: should swap the last two dims, (1, 2) or (-2, -1)
        return scores.softmax(-1)


attention = TinyAttention()
x = torch.randn(2, 5, 8)

# %% tags=["raises-exception"]
attention(x)

# %% [markdown]
# Now the post-mortem, with the debugger's input scripted: the same debugger that `%debug` opens
# (IPython's `Pdb`, an extended `pdb.Pdb`), on the same traceback, fed the commands a person would
# type. Its output is what you would see. (`[... skipping hidden frames]` is IPython hiding its own
# internals from the stack.)

# %%
from IPython.core.debugger import Pdb  # the debugger %debug opens (a subclass of pdb.Pdb)


def post_mortem(tb, commands: str) -> str:
    """Run the debugger on a traceback with pre-written commands; return what it printed."""
    out = io.StringIO()
    debugger = Pdb(stdin=io.StringIO(commands), stdout=out, context=3)
    debugger.use_rawinput = False  # read commands from stdin, not from the terminal
    debugger.set_theme_name("nocolor")  # plain text, so the output reads well on GitHub too
    debugger.reset()
    debugger.interaction(None, tb)
    return out.getvalue()


session = post_mortem(sys.last_traceback, "\n".join([
    "where",
    "p q.shape, k.shape, k.transpose(0, 1).shape",
    "p x.dtype, x.device",
    "up",
    "quit",
]))
print(session)
assert "torch.Size([5, 2, 8])" in session  # the transposed k: batch and time swapped

# %% [markdown]
# The second command shows the bug at once: `k.transpose(0, 1)` is `5×2×8` — batch and time were
# swapped instead of time and features. `where` shows why the debugger starts in `forward`: the
# error is raised by the `@` operator, in C++, so `forward` is the innermost *Python* frame. `up`
# moves to its caller — here PyTorch's `Module._call_impl`, and one more `up` reaches the cell.
#
# Without a debugger at all, the traceback object itself holds every frame and its locals. A small
# function that lists the tensors alive in each frame is a handy post-mortem of its own:

# %%
def tensors_in_traceback(tb):
    """For each frame of a traceback: its function name and the tensors among its local variables."""
    report = []
    while tb is not None:
        frame = tb.tb_frame
        if "IPython" in frame.f_code.co_filename:  # IPython's own frames, above the cell
            tb = tb.tb_next
            continue
        tensors = {name: (tuple(value.shape), str(value.dtype), str(value.device))
                   for name, value in frame.f_locals.items() if torch.is_tensor(value)}
        report.append((frame.f_code.co_name, tb.tb_lineno, tensors))
        tb = tb.tb_next
    return report


for function, line, tensors in tensors_in_traceback(sys.last_traceback):
    print(f"{function} (line {line})")
    for name, (shape, dtype, device) in tensors.items():
        print(f"    {name:>6}: shape={shape}, dtype={dtype}, device={device}")

forward_frame = tensors_in_traceback(sys.last_traceback)[-1]
assert forward_frame[0] == "forward" and forward_frame[2]["k"][0] == (2, 5, 8)

# %% [markdown]
# ## 5. `%explain`: the reading, done for you
#
# Everything above is a recipe: find your innermost frame, look at the operands, map the message to a
# cause. `torch_nbdebug` does it for every PyTorch error. After `%load_ext torch_nbdebug`, a failing cell
# gets **one paragraph under its traceback** (read post mortem from the traceback: nothing is run
# again), and errors that are not PyTorch's stay untouched. `%explain --auto off` turns it off.

# %%
%load_ext torch_nbdebug
import torch_nbdebug

# %% [markdown]
# The classifier from section 1 again, now with convolutions: it was built for 8×8 images and gets
# 32×32 ones. The message says `2x2048 and 128x10`; the paragraph says which layer and why.

# %%
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(8 * 4 * 4, 10)  # 4x4 after pooling: built for 8x8 inputs

    def forward(self, x):
        h = self.features(x)
        return self.fc(h.flatten(1))


cnn = SmallCNN()
images = torch.randn(2, 3, 32, 32)

# %% tags=["raises-exception"]
logits = cnn(images)

# %% [markdown]
# `%explain` on its own line (like `%debug`) shows the whole diagnosis of the last error as a card:
# the kind, the ATen op, the module *as you write it* (`cnn.fc`), your line, every operand with the
# module that produced it, and the fix. `-o` returns it as a `Diagnosis`, plain data you can test.

# %%
%explain

# %%
diagnosis = %explain -o
print(diagnosis.kind, diagnosis.op, diagnosis.module, diagnosis.lineno)
assert (diagnosis.kind, diagnosis.module) == ("shape", "cnn.fc")
assert "in_features=2048" in diagnosis.hint

# %% [markdown]
# ### The errors whose messages name no line: run the cell under `%%explain`
#
# Autograd errors are raised by `backward()`, far from their cause. *"modified by an inplace
# operation ... output 0 of Sigmoid, is at version 1"* names neither the line that saved the tensor nor
# the op that modified it, and anomaly mode points at the backward that failed, not at the culprit.
# `%%explain` on the first line of the cell runs it with a light recorder (module hooks and a
# function-level mode, no re-run, no anomaly mode) and re-raises your exception unchanged; the card
# under the traceback then names both lines.

# %%
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)  # saves memory... and modifies sigmoid's saved output

    def forward(self, x):
        s = torch.sigmoid(self.proj(x))
        return self.act(s)


gate = Gate()

# %% tags=["raises-exception"]
%%explain
out = gate(torch.randn(3, 4))
out.sum().backward()

# %%
print(_explain.culprit_op, "in", _explain.culprit_module, "at line", _explain.culprit_lineno)
assert (_explain.kind, _explain.culprit_module) == ("inplace", "gate.act")

# %% [markdown]
# **Graph reuse.** *"Trying to backward through the graph a second time"* does not say which tensor
# carried the old graph. Here a hidden state is carried from one iteration to the next; the card names
# the line that made it and the `.detach()` to add.

# %% tags=["raises-exception"]
%%explain
rnn_cell = nn.Linear(4, 4)
hidden = torch.zeros(1, 4)
for step in range(3):
    hidden = torch.tanh(rnn_cell(hidden))
    loss = hidden.sum()
    loss.backward()

# %%
assert (_explain.kind, _explain.culprit_lineno) == ("graph_reuse", 4)

# %% [markdown]
# **A cut gradient chain.** *"element 0 of tensors does not require grad"* does not say where the
# chain was cut. The tempting fix, `loss.requires_grad = True`, silences the error and trains nothing:
# the card says so, and names the line that cut the chain.

# %% tags=["raises-exception"]
%%explain
features = gate(torch.randn(3, 4)).detach()  # e.g. to log them... but then used for the loss
loss = features.pow(2).mean()
loss.backward()

# %%
assert (_explain.kind, _explain.culprit_op, _explain.culprit_lineno) == ("no_grad", "detach", 1)
assert "nothing trains" in _explain.warning

# %% [markdown]
# **Indices, and the CUDA device-side assert.** On a GPU an out-of-range token id from section 3 is a
# device-side assert: the CUDA context is broken, the kernel must restart, and the traceback blames a
# later line. The card says so and offers `%%explain --check-indices`: it checks index arguments
# (embedding ids, class targets, `gather`/`index_select` indices) on their way to each op, so the next
# run stops **at the right line, with the bad value and its position, before the assert**. It costs a
# reduction and a synchronisation per indexed op, so it is opt-in. On the CPU it gives the same answer:

# %% tags=["raises-exception"]
%%explain --check-indices
hidden = lm_embedding(tokens)

# %%
print(_explain.hint)
assert _explain.kind == "index" and "holds 100" in _explain.hint

# %% [markdown]
# The Python twins do the same without a notebook: `with torch_nbdebug.explain() as ex:` (the exception
# passes through unchanged; afterwards `ex.diagnosis`) and `torch_nbdebug.explain_exception(exc)` for
# an exception you caught.

# %%
try:
    with torch_nbdebug.explain() as ex:
        nn.functional.cross_entropy(torch.randn(4, 3), torch.tensor([0.0, 2.0, 1.0, 1.0]))
except RuntimeError as err:
    print(type(err).__name__, "passed through:", err)
print(ex.diagnosis.text())
assert ex.diagnosis.kind == "dtype" and "target.long()" in ex.diagnosis.hint

# %% [markdown]
# ## Summary
#
# * Read tracebacks **bottom up**: the message, then the innermost frame that is *your* code.
# * PyTorch's messages carry the numbers you need (shapes, the bad label, the bad index).
# * On the GPU, errors are reported **late**: reproduce on the CPU, or set `CUDA_LAUNCH_BLOCKING=1`
#   before CUDA starts, and restart the kernel after a device-side assert.
# * After an error, `%debug` puts you *in* the failing frame: `up`, `down`, `p x.shape`.
#   The traceback object (`sys.last_traceback`) holds every frame's locals if you prefer code.
# * `%load_ext torch_nbdebug` explains every PyTorch error under its traceback; `%explain` shows the
#   full card; `%%explain` names the culprit of in-place, graph-reuse and no-grad errors;
#   `%%explain --check-indices` catches the index behind a device-side assert at its line.
#
# Next: **02 · Hunting NaNs** — the errors that do not raise at all.
# %% [markdown]
# ## Exercise: the classifier that does not fit its images
#
# A small CNN for 28×28 images. Run the cell, read the traceback bottom up and the paragraph
# `%explain` adds under it (or run `%explain` for the full card), and fix the model — not the data —
# so that `logits` has shape `(2, 10)`. Why is the right number what it is?

# %% tags=["raises-exception"]
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 14 * 14, 10)  # 28x28 images, halved by the pool

    def forward(self, images):
        h = self.pool(torch.relu(self.conv(images)))
        return self.fc(h.flatten(1))


cnn = SmallCNN()
images = torch.randn(2, 1, 28, 28)
logits = cnn(images)

# %% [markdown]
# <details><summary>Solution</summary>
#
# The last line: `mat1 and mat2 shapes cannot be multiplied (2x1352 and 1568x10)`; the innermost
# frame of yours: `return self.fc(h.flatten(1))`. `cnn.fc` was built for 1568 = 8·14·14 features and
# gets 1352. A 3×3 convolution without padding takes one pixel off each border: 28 → 26, and the
# pool halves that to 13, so 8·13·13 = 1352. Either build `fc` for 8·13·13 inputs, or keep the size
# with `padding=1` in the convolution (28 → 28 → 14, and 8·14·14 is right), or let
# `nn.LazyLinear(10)` find the size at the first call.
#
# ```python
# class SmallCNN(nn.Module):
#     def __init__(self):
#         super().__init__()
#         self.conv = nn.Conv2d(1, 8, kernel_size=3, padding=1)  # keeps 28x28
#         self.pool = nn.MaxPool2d(2)                             # 28 -> 14
#         self.fc = nn.Linear(8 * 14 * 14, 10)
#
#     def forward(self, images):
#         h = self.pool(torch.relu(self.conv(images)))
#         return self.fc(h.flatten(1))
#
#
# cnn = SmallCNN()
# logits = cnn(images)
# assert logits.shape == (2, 10)
# ```
#
# </details>
