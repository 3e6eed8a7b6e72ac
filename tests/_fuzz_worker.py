"""The process that runs the plan fuzz's examples (tests/test_fuzz.py).

An example is a JSON object (a "spec"): mesh sizes, the plan's keyword arguments
as Python expressions, a model, a loss form, a batch shape and `accumulate`. For
each one this worker builds the mesh, plan, model and batch, runs
`eqxpar.train.init`, `make_step`, compiles and runs ONE step, and compares the
step's loss, gradients, gradient norm and updated parameters with a
single-device `jax.value_and_grad` of the same loss at the same initial
parameters. Where the spec says so it also: enters the model through
`from_pretrained(path, plan)` (checked bit for bit against `from_pretrained(path)`
in natural order); builds the step with `skip_nonfinite=True` and first runs it
on a batch with a NaN (the state must stay bit for bit as it was); and after the
step saves the state with `CheckpointManager`, restores it under the journey's
plan (bit for bit the trained state in natural order) and runs one more step
there, compared with one device from the trained parameters. It reports one
result per example:

- `ok`: the step ran and matched one device;
- `eqxpar_error`: an `eqxpar.EqxparError` was raised (bad input, rejected cleanly);
- `other_error`: any other exception (a finding: the type, message and traceback);
- `mismatch`: the step ran but did not match one device (a finding);
- and, with any of them, the warnings the example raised (findings too, except
  XLA:CPU's note that it declined some donated buffers, which pyproject.toml
  ignores for the whole suite, and JAX's note that it could not read an entry
  of the workers' shared compilation cache another worker was still writing).

Aborts (XLA check failures kill the process) and hangs (a collective whose peers
never arrive) cannot be caught here: before each phase the worker prints which
phase it enters, so the parent (tests/test_fuzz.py) can tell which example and
phase died or stalled, kill this process and start a fresh one.

Protocol: one spec per line on stdin; replies on stdout, each line starting with
`@@FUZZ ` then JSON: `{"event": "ready"}` once, `{"event": "phase", ...}` per
phase, `{"event": "result", ...}` per example. Anything else on stdout or stderr
is ignored (the parent keeps stderr's tail to explain an abort).

Run one example by hand (the harness prints this command for every finding,
with `EQXPAR_FUZZ_JAXTYPING=...` in front when the suite type-checks eqxpar):

    .venv/bin/python tests/_fuzz_worker.py --spec '<json>'            # result as JSON
    .venv/bin/python tests/_fuzz_worker.py --snippet '<json>'         # a Python reproducer

Environment: `EQXPAR_FUZZ_JAXTYPING="eqxpar,beartype.beartype"` installs the
jaxtyping import hook the test suite runs eqxpar under (the last name is the type
checker); `EQXPAR_FUZZ_FULL_OPT=1` keeps XLA's default code generation (the fuzz
turns LLVM's effort down and uses XLA:CPU's elemental emitter for fusions: the
models are tiny, compilation is nearly all of the cost, and the HLO passes that
partition the program and place and schedule the collectives run either way);
`EQXPAR_FUZZ_CACHE_DIR` shares a JAX compilation cache between workers.
"""

import os
import sys

if __name__ == "__main__" or __package__ in (None, ""):
    # Run as a script: make `import tests._fuzz_worker`-style imports and eqxpar
    # (from the checkout) importable.
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)

# --- XLA set-up: what tests/conftest.py sets, after the type-checking hook (which must
# be in place before eqxpar is imported) and before JAX starts a backend ------------

_hook = os.environ.get("EQXPAR_FUZZ_JAXTYPING", "").strip()
if _hook and "eqxpar" not in sys.modules:
    import jaxtyping

    *_packages, _checker = _hook.split(",")
    jaxtyping.install_import_hook(_packages, _checker)

from eqxpar.runtime import supported_xla_flags  # noqa: E402
from tests._compile_flags import CHEAP_CODEGEN, DEVICES_8, IN_ORDER  # noqa: E402

# The worker sets these flags itself, replacing any the caller's XLA_FLAGS holds.
_OWN_FLAGS = tuple(f.split("=")[0] + "=" for f in (DEVICES_8, IN_ORDER, *CHEAP_CODEGEN))
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_OWN_FLAGS)]
_flags += [DEVICES_8, IN_ORDER]
if os.environ.get("EQXPAR_FUZZ_FULL_OPT", "0") != "1":
    # Cheap code generation, as the rest of the suite (tests/_compile_flags.py): the
    # HLO passes that partition the program and place and schedule its collectives
    # are the same either way.
    _flags += CHEAP_CODEGEN
# Only the flags this jaxlib knows (XLA aborts on any other). JAX is imported by now
# but no backend has started, and XLA reads XLA_FLAGS when the first one starts.
os.environ["XLA_FLAGS"] = " ".join(supported_xla_flags(_flags))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar import nn, rules  # noqa: E402
from eqxpar.checkpoint import CheckpointManager  # noqa: E402
from eqxpar.nn import in_natural_order  # noqa: E402
from eqxpar.pipeline import PipelineLoss, stage_rules  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py

if os.environ.get("EQXPAR_FUZZ_CACHE_DIR"):
    # A compilation cache shared by the harness's workers (and their restarts after
    # an abort): eager ops, model builds and single-device references compile once
    # per fuzz run instead of once per worker process.
    jax.config.update("jax_compilation_cache_dir", os.environ["EQXPAR_FUZZ_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

PREFIX = "@@FUZZ "

#: Warnings eqxpar issues on purpose for plans the fuzz draws on purpose: an
#: UnusedAxisWarning says a mesh axis splits nothing (e.g. tensor=4 for a model
#: without logical axes); an AccumulationWarning says micro-batches make an MoE
#: GPT's load-balance loss a mean of per-micro-batch values (the fuzz draws MoE
#: GPTs with `accumulate` > 1 without that loss, where the micro-batches are exact,
#: so it does not arise). Counted, not findings. Every other warning is a finding.
EXPECTED_WARNINGS = tuple(
    w
    for w in (getattr(eqxpar, "UnusedAxisWarning", None), getattr(eqxpar, "AccumulationWarning", None))
    if isinstance(w, type)
)

#: The step's optimizer: SGD with this learning rate, behind a transformation that
#: keeps the gradient it was given in its state (so one step yields the gradient
#: exactly as the step computed it, in the optimizer state's sharding).
LR = 0.1

# --- Tolerances ---------------------------------------------------------------------
#
# float32: sharded reductions sum in another order than one device, so results
# differ in the last bits: rtol 1e-5 (the suite's contract, tests/_helpers.py).
# The loss is compared elementwise; each gradient leaf relative to its own scale,
# max|a - b| <= rtol * max|b| + atol: every entry is a sum over many paths whose
# order the split changes, so its error scales with the terms (the leaf's scale),
# not with the entry, which may sit near zero (assert_trees_close_to_scale).
F32 = {"loss_rtol": 1e-5, "loss_atol": 1e-6, "grad_rtol": 1e-5, "grad_atol": 1e-6, "param_ulps": 4e-7}
# bfloat16 anywhere (stored weights, compute or gradient reduction): 8 significant
# bits, relative rounding 2^-9 = 0.2% per operation, compounded over a few layers
# and summed in a different order than the float32 reference. README.md (mixed
# precision) documents 1e-2 for the loss and a gradient direction within cosine
# 0.99; the per-leaf bound is 0.1 of the leaf's scale (ten times the float32
# loss tolerance's bfloat16 counterpart) and the whole gradient's cosine >= 0.99.
BF16 = {"loss_rtol": 2e-2, "loss_atol": 1e-2, "grad_rtol": 1e-1, "grad_atol": 1e-3, "param_ulps": 8e-3}
COSINE = 0.99

# --- Models -------------------------------------------------------------------------


class SeqBlock(eqx.Module):
    """Pre-norm residual MLP block of eqxpar.nn layers on (batch, seq, d)."""

    norm: nn.LayerNorm
    mlp: nn.MLP

    def __init__(self, d, hidden, activation, key):
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.MLP(d, hidden, activation=activation, key=key)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class SeqMLP(eqx.Module):
    """A sequence regression model of eqxpar.nn layers with logical axes: a
    replicated input projection, a scanned stack of MLP blocks, a final norm."""

    w_in: jax.Array = eqxpar.param(axes=("embed", None))
    blocks: nn.Stacked
    norm: nn.RMSNorm

    def __init__(self, d, hidden, depth, activation, *, key):
        k1, k2 = jax.random.split(key)
        self.w_in = jax.random.normal(k1, (d, d)) / np.sqrt(d)
        self.blocks = nn.Stacked(lambda k: SeqBlock(d, hidden, activation, k), depth=depth, key=k2)
        self.norm = nn.RMSNorm(d)


def _seq_first(m, batch):
    # The inputs are whole sequences; the layers expect this device's block
    # under sequence parallelism.
    return nn.split_sequence(batch[0]) @ m.w_in


def _seq_last(m, h, batch):
    per_token = jnp.mean((m.norm(h) - nn.split_sequence(batch[1])) ** 2, axis=-1)
    return nn.sequence_mean(per_token)


SEQ_PIPELINE_LOSS = PipelineLoss(_seq_first, lambda m: m.blocks, _seq_last)


def _seq_first_raw(m, batch):
    return nn.split_sequence(batch[0])  # no weights before the stack


SEQ_PIPELINE_RAW_LOSS = PipelineLoss(_seq_first_raw, lambda m: m.blocks, _seq_last)


def seq_loss_raw_reference(m, batch):
    x, y = batch
    return jnp.mean((m.norm(m.blocks(x)) - y) ** 2)


def seq_loss_sp(m, batch):
    """The sequence model's loss written for sequence parallelism (split_sequence,
    sequence_mean): a plain function."""
    return _seq_last(m, m.blocks(_seq_first(m, batch)), batch)


def seq_loss_naive(m, batch):
    """The same loss without split_sequence / sequence_mean."""
    x, y = batch
    h = m.blocks(x @ m.w_in)
    return jnp.mean((m.norm(h) - y) ** 2)


class TinyLM(eqx.Module):
    """Vocabulary-parallel embedding and head around a stack of MLP blocks."""

    embed: nn.Embedding
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head: nn.Unembed

    def __init__(self, vocab, d, hidden, depth, activation, *, key):
        k = jax.random.split(key, 3)
        self.embed = nn.Embedding(vocab, d, key=k[0])
        self.blocks = nn.Stacked(lambda kk: SeqBlock(d, hidden, activation, kk), depth=depth, key=k[1])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Unembed(d, vocab, key=k[2])


def _lm_last(m, h, tokens):
    # As eqxpar's GPT and the docs do: the head says whether its logits are a
    # vocabulary shard (rules that keep "vocab" whole make them the whole row, and
    # under sequence parallelism this device's sequence block: average the blocks).
    split = m.head.vocab_split()
    per_token = nn.cross_entropy(m.head(m.norm(h)), tokens[:, 1:], head=m.head)
    return jnp.mean(per_token) if split else nn.sequence_mean(per_token)


LM_PIPELINE_LOSS = PipelineLoss(
    first=lambda m, tokens: m.embed(tokens[:, :-1]),
    stack=lambda m: m.blocks,
    last=_lm_last,
)


def lm_loss(m, tokens):
    return LM_PIPELINE_LOSS(m, tokens)


GPT_PIPELINE_LOSS = PipelineLoss(eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last)


def mse_loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


#: (model kind, loss form) -> loss function. Module-level objects, so that the
#: single-device reference (a filter_jit per loss) compiles once per shape.
LOSSES = {
    ("plain", "plain"): mse_loss,
    ("classifier", "plain"): eqxpar.models.MLPClassifier.loss,
    ("seq", "pipeline"): SEQ_PIPELINE_LOSS,
    ("seq", "plain"): seq_loss_sp,
    ("seq", "naive"): seq_loss_naive,
    ("seq", "pipeline_raw"): SEQ_PIPELINE_RAW_LOSS,
    ("lm", "pipeline"): LM_PIPELINE_LOSS,
    ("lm", "plain"): lm_loss,
    ("gpt", "pipeline"): GPT_PIPELINE_LOSS,
    ("gpt", "plain"): eqxpar.models.lm_loss,
    ("moe", "plain"): eqxpar.models.lm_loss,
    ("pretrained", "pipeline"): GPT_PIPELINE_LOSS,
    ("pretrained", "plain"): eqxpar.models.lm_loss,
}

#: The single-device reference's loss per model (or per (model, loss form) where
#: the form computes something else): the plain composition. The loss forms of a
#: model are the same function on one device with no plan (a PipelineLoss called
#: directly is its sequential composition; split_sequence is the identity and
#: sequence_mean the mean there), so one reference serves them.
REFERENCE_LOSS = {
    "plain": mse_loss,
    "classifier": eqxpar.models.MLPClassifier.loss,
    "seq": seq_loss_naive,
    "lm": lm_loss,
    "gpt": eqxpar.models.lm_loss,
    "moe": eqxpar.models.lm_loss,
    "pretrained": eqxpar.models.lm_loss,
    ("seq", "pipeline_raw"): seq_loss_raw_reference,
}

#: How a snippet writes each loss.
LOSS_SOURCE = {
    ("plain", "plain"): "W.mse_loss",
    ("classifier", "plain"): "eqxpar.models.MLPClassifier.loss",
    ("seq", "pipeline"): "W.SEQ_PIPELINE_LOSS",
    ("seq", "plain"): "W.seq_loss_sp",
    ("seq", "naive"): "W.seq_loss_naive",
    ("seq", "pipeline_raw"): "W.SEQ_PIPELINE_RAW_LOSS",
    ("lm", "pipeline"): "W.LM_PIPELINE_LOSS",
    ("lm", "plain"): "W.lm_loss",
    ("gpt", "pipeline"): "W.GPT_PIPELINE_LOSS",
    ("gpt", "plain"): "eqxpar.models.lm_loss",
    ("moe", "plain"): "eqxpar.models.lm_loss",
    ("pretrained", "pipeline"): "W.GPT_PIPELINE_LOSS",
    ("pretrained", "plain"): "eqxpar.models.lm_loss",
}

#: The tiny Hugging Face checkpoints a "pretrained" spec names (tests/data; written
#: by transformers, see tests/test_pretrained.py): 2 layers each, and llama8, the
#: 8-layer Llama of tests/test_pipeline_journeys.py, for pipelines.
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PRETRAINED = {
    name: os.path.join(_DATA, "pretrained", name)
    for name in ("llama", "qwen2", "mistral", "gpt2", "llama3_rope", "mixtral")
}
PRETRAINED["llama8"] = os.path.join(_DATA, "pipeline_journey", "base")


def pretrained_path(name: str) -> str:
    return PRETRAINED[name]


def model_source(m: dict) -> str:
    """Python source that builds the spec's model (with `key` in scope)."""
    kind = m["kind"]
    if kind == "plain":
        return f"eqx.nn.MLP({m['d_in']}, {m['d_out']}, {m['hidden']}, {m['depth']}, key=key)"
    if kind == "classifier":
        return (
            f"eqxpar.models.MLPClassifier({m['d_in']}, {m['hidden']}, {m['classes']}, "
            f"depth={m['depth']}, key=key)"
        )
    if kind == "seq":
        return f"W.SeqMLP({m['d']}, {m['hidden']}, {m['depth']}, {m['activation']!r}, key=key)"
    if kind == "lm":
        return f"W.TinyLM({m['vocab']}, {m['d']}, {m['hidden']}, {m['depth']}, {m['activation']!r}, key=key)"
    if kind in ("gpt", "moe"):
        moe = ""
        if kind == "moe":
            moe = (
                f", moe_every={m['moe_every']}, experts={m['experts']}, top_k={m['top_k']}, "
                f"moe_score={m['score']!r}, num_shared_experts={m['shared']}, "
                f"capacity_factor={m['capacity']!r}, load_balance_coef={m['load_balance']!r}"
            )
        return (
            f"eqxpar.models.GPT(eqxpar.models.GPTConfig(vocab_size={m['vocab']}, d_model={m['d']}, "
            f"num_heads={m['heads']}, num_layers={m['depth']}, d_hidden={m['hidden']}, "
            f"num_kv_heads={m['kv_heads']!r}, activation={m['activation']!r}, norm={m['norm']!r}, "
            f"tied={m['tied']!r}, max_seq_len={m['max_seq_len']}{moe}), key=key)"
        )
    if kind == "pretrained":
        return f"eqxpar.models.from_pretrained(W.pretrained_path({m['name']!r}))"
    raise ValueError(f"unknown model kind {kind!r}")


def batch_source(spec: dict) -> str:
    """Python source that builds the spec's batch (with `rng`, a numpy Generator, in
    scope): host arrays, so building one compiles nothing."""
    m, b = spec["model"], spec["batch"]
    n, s = b["size"], b["seq"]
    kind = m["kind"]
    normal = "rng.standard_normal({}, dtype=np.float32)".format
    if kind == "plain":
        return f"({normal((n, m['d_in']))}, {normal((n, m['d_out']))})"
    if kind == "classifier":
        return f"({normal((n, m['d_in']))}, rng.integers(0, {m['classes']}, ({n},), dtype=np.int32))"
    if kind == "seq":
        return f"({normal((n, s, m['d']))}, {normal((n, s, m['d']))})"
    return f"rng.integers(0, {m['vocab']}, ({n}, {s + 1}), dtype=np.int32)"


NAMESPACE = {
    "eqxpar": eqxpar,
    "rules": rules,
    "stage_rules": stage_rules,
    "P": P,
    "jnp": jnp,
    "jax": jax,
    "np": np,
    "eqx": eqx,
}


def _eval(source: str):
    return eval(source, dict(NAMESPACE))  # noqa: S307 (the harness writes these)


# --- The step's optimizer -------------------------------------------------------------


def keep_gradient() -> optax.GradientTransformation:
    """Passes the updates through and keeps them (the raw gradient) in its state."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, state, params=None):
        del state, params
        return updates, updates

    return optax.GradientTransformation(init, update)


def optimizer() -> optax.GradientTransformation:
    return optax.chain(keep_gradient(), optax.sgd(LR))


# --- Reference ------------------------------------------------------------------------

_REFERENCE: dict = {}
_REFERENCE_RESULTS: dict = {}


def reference(loss_fn, model, batch, cache_key=None, *, whole=False):
    """Loss and gradients on one device (plain jax.jit of `eqx.filter_value_and_grad`;
    no plan active), as host float64 values; cached under `cache_key` (the model,
    seed, batch, loss and param_dtype determine them).

    Every loss here but an MoE GPT's with a load-balance loss (`whole`: one call
    on the whole batch) is an equal-weight mean over the batch's rows, so the
    batch's loss and gradient are the means of each row's: the reference runs one
    row at a time (summing in float64), which compiles once per model and sequence
    length rather than once per batch size.
    """
    if cache_key is not None and cache_key in _REFERENCE_RESULTS:
        return _REFERENCE_RESULTS[cache_key]
    fn = _REFERENCE.get(id(loss_fn))
    if fn is None:
        fn = _REFERENCE[id(loss_fn)] = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    device = jax.devices()[0]
    model = jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, model)
    rows = jax.tree.leaves(batch)[0].shape[0]
    loss_sum, grad_sum = 0.0, None
    # `whole`: a loss that is not a mean over rows runs on the whole batch.
    for i in range(1 if whole else rows):
        part = slice(None) if whole else slice(i, i + 1)
        row = jax.tree.map(lambda x, part=part: jax.device_put(x[part], device), batch)
        loss, grads = fn(model, row)
        grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
        loss_sum += float(loss)
        grad_sum = grads if grad_sum is None else jax.tree.map(np.add, grad_sum, grads)
    n = 1 if whole else rows
    out = loss_sum / n, jax.tree.map(lambda g: g / n, grad_sum)
    if cache_key is not None:
        _REFERENCE_RESULTS[cache_key] = out
    return out


# --- One example ------------------------------------------------------------------------


def _emit(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Phases:
    def __init__(self, announce: bool):
        self.announce = announce
        self.name = "start"
        self.times: dict[str, float] = {}
        self._t = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.times[self.name] = round(self.times.get(self.name, 0.0) + now - self._t, 4)
        self.name, self._t = name, now
        if self.announce:
            _emit({"event": "phase", "phase": name})

    def close(self) -> dict[str, float]:
        self("done")
        self.times.pop("done", None)
        self.times.pop("start", None)
        return self.times


class Mismatch(AssertionError):
    pass


def _self_test(what):
    """tests/test_fuzz.py checks the harness with specs that abort or hang on purpose."""
    if what == "abort":
        os.abort()
    if what == "hang":
        time.sleep(3600)


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)) if eqx.is_array(x) else x, tree)


def _to_f32(tree):
    return jax.tree.map(
        lambda x: (
            np.asarray(x, np.float32) if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x
        ),
        tree,
    )


def _leaves_with_paths(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat if x is not None and eqx.is_array(x)]


def compare(plan, metrics, new_model, captured, init_params, ref_loss, ref_grads) -> dict:
    """Raise Mismatch naming the first quantity off one device; return the errors."""
    bf16 = jnp.dtype(jnp.bfloat16)
    low = any(
        d is not None and jnp.dtype(d) == bf16
        for d in (plan.param_dtype, plan.compute_dtype, plan.reduce_dtype)
    )
    tol = BF16 if low else F32
    report: dict = {"tolerance": "bfloat16" if low else "float32"}

    loss = float(metrics["loss"])
    report["loss"] = [loss, ref_loss]
    if not abs(loss - ref_loss) <= tol["loss_rtol"] * abs(ref_loss) + tol["loss_atol"]:
        raise Mismatch(f"loss {loss!r} vs one device {ref_loss!r} ({report['tolerance']} tolerance)")

    got = _leaves_with_paths(_host(captured))
    want = _leaves_with_paths(_host(ref_grads))
    if [p for p, _ in got] != [p for p, _ in want]:
        raise Mismatch(f"gradient leaves differ: {[p for p, _ in got]} vs {[p for p, _ in want]}")
    worst = 0.0
    dot = na = nb = 0.0
    for (path, a), (_, b) in zip(got, want, strict=True):
        if a.shape != b.shape:
            raise Mismatch(f"gradient {path}: shape {a.shape} vs one device {b.shape}")
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not np.all(np.isfinite(a64)):
            raise Mismatch(f"gradient {path}: non-finite values")
        scale = float(np.max(np.abs(b64))) if b64.size else 0.0
        err = float(np.max(np.abs(a64 - b64))) if b64.size else 0.0
        bound = tol["grad_rtol"] * scale + tol["grad_atol"]
        worst = max(worst, err / bound)
        if err > bound:
            raise Mismatch(
                f"gradient {path}: max|diff| {err:.3g} > {bound:.3g} (scale {scale:.3g}, "
                f"{report['tolerance']} tolerance)"
            )
        dot += float(np.sum(a64 * b64))
        na += float(np.sum(a64 * a64))
        nb += float(np.sum(b64 * b64))
    report["grad_worst_vs_bound"] = worst
    if low and na > 0 and nb > 0:
        cosine = dot / math.sqrt(na * nb)
        report["cosine"] = cosine
        if cosine < COSINE:
            raise Mismatch(f"gradient direction: cosine {cosine:.5f} < {COSINE}")

    norm, ref_norm = float(metrics["grad_norm"]), math.sqrt(nb)
    report["grad_norm"] = [norm, ref_norm]
    if not abs(norm - ref_norm) <= tol["grad_rtol"] * ref_norm + tol["grad_atol"]:
        raise Mismatch(f"grad_norm {norm!r} vs one device {ref_norm!r}")

    # The SGD update, in the stored dtype: p - LR * g.
    new = _leaves_with_paths(_host(eqx.filter(new_model, eqx.is_inexact_array)))
    old = _leaves_with_paths(init_params)
    for (path, a), (_, p), (_, g) in zip(new, old, want, strict=True):
        expected = np.asarray(p, np.float64) - LR * np.asarray(g, np.float64)
        err = float(np.max(np.abs(np.asarray(a, np.float64) - expected))) if expected.size else 0.0
        gscale = float(np.max(np.abs(g))) if g.size else 0.0
        pscale = float(np.max(np.abs(expected))) if expected.size else 0.0
        bound = tol["param_ulps"] * pscale + LR * (tol["grad_rtol"] * gscale + tol["grad_atol"])
        if err > bound:
            raise Mismatch(f"updated parameter {path}: max|diff| {err:.3g} > {bound:.3g}")
        if plan.param_dtype is not None and a.dtype != plan.param_dtype:
            raise Mismatch(
                f"parameter {path} has dtype {a.dtype} after the step, not param_dtype {plan.param_dtype}"
            )
    return report


_DOT_BF16 = re.compile(r"dot_general.*bf16")


_MODELS: dict = {}


def build_model(model_spec: dict, seed: int):
    """The spec's model, cached: examples share models (modules are immutable).
    Built eagerly: its ops' compilations are cached by shape, so after the first
    few models another one costs milliseconds (a jit would compile each anew)."""
    key = json.dumps([model_spec, seed], sort_keys=True)
    if key not in _MODELS:
        namespace = {**NAMESPACE, "W": sys.modules[__name__], "key": jax.random.key(seed)}
        _MODELS[key] = eval(model_source(model_spec), namespace)  # noqa: S307
    return _MODELS[key]


def build(spec: dict):
    """Mesh, plan, model, loss, batch from a spec (each may raise). A "pretrained"
    model enters as users take one: read into the plan (its stack in the plan's
    order, each device's blocks only)."""
    plan = build_plan(spec)
    seed = spec.get("seed", 0)
    if spec["model"]["kind"] == "pretrained":
        model = eqxpar.models.from_pretrained(pretrained_path(spec["model"]["name"]), plan)
    else:
        model = build_model(spec["model"], seed)
    loss_fn = LOSSES[(spec["model"]["kind"], spec["loss"])]
    return plan, model, loss_fn, build_batch(spec, spec["batch"]["size"], 1000 + seed)


def build_plan(layout: dict):
    mesh = eqxpar.make_mesh(**layout["mesh"])
    return eqxpar.Plan(mesh, **{k: _eval(v) for k, v in layout["plan"].items()})


def build_batch(spec: dict, size: int, seed: int):
    source = batch_source(dict(spec, batch=dict(spec["batch"], size=size)))
    return eval(source, {**NAMESPACE, "rng": np.random.default_rng(seed)})  # noqa: S307


def whole_batch_reference(spec: dict) -> bool:
    """Whether the loss is not a mean of per-row losses: an MoE GPT's load-balance
    loss multiplies two means over all the batch's tokens."""
    m = spec["model"]
    return m["kind"] == "moe" and m["load_balance"] != 0


def _bits(tree) -> list:
    """(path, host array) for every array leaf (PRNG keys as their key data)."""
    out = []
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    for path, x in flat:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append((jax.tree_util.keystr(path), np.asarray(jax.device_get(x))))
    return out


def assert_same_bits(got, want, what: str) -> None:
    if [p for p, _ in got] != [p for p, _ in want]:
        raise Mismatch(f"{what}: leaves differ: {[p for p, _ in got]} vs {[p for p, _ in want]}")
    for (path, a), (_, b) in zip(got, want, strict=True):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise Mismatch(f"{what}: {path} is {a.dtype}{list(a.shape)}, not {b.dtype}{list(b.shape)}")
        if not np.array_equal(a, b, equal_nan=True):
            raise Mismatch(f"{what}: {path} differs (max|diff| {np.max(np.abs(a - b)):.3g})")


def check_entry(spec: dict, model) -> None:
    """`from_pretrained(path, plan)`, in natural order, holds the bits of
    `from_pretrained(path)` (one device)."""
    natural = build_model(spec["model"], spec.get("seed", 0))
    assert_same_bits(
        _bits(in_natural_order(model)), _bits(natural), "from_pretrained(path, plan) vs from_pretrained(path)"
    )


def poisoned_step(step, state, batch):
    """A step on the batch with a NaN in its first input: skipped (the flag set,
    the state's arrays bit for bit as they were, one skipped step counted)."""
    x = np.array(batch[0])
    x.flat[0] = np.nan
    before = _bits((state.model, state.opt_state))
    new_state, metrics = step(state, (x, *batch[1:]))
    if not bool(metrics["skipped"]) or int(metrics["skipped_steps"]) != 1:
        raise Mismatch(
            f"skip_nonfinite: a batch with a NaN gave skipped={bool(metrics['skipped'])}, "
            f"skipped_steps={int(metrics['skipped_steps'])}, loss {float(metrics['loss'])!r}"
        )
    assert_same_bits(_bits((new_state.model, new_state.opt_state)), before, "skip_nonfinite: a skipped step")
    return new_state


def step_and_compare(spec, phase, plan, state, step, batch, prefix=""):
    """Compile and run `step` once from `state`, compare with one device at the
    parameters it started from; returns (new state, report)."""
    init_params = _host(eqx.filter(state.model, eqx.is_inexact_array))
    phase(prefix + "compile")
    lowered = step.lower(state, batch)
    low_compute = plan.compute_dtype is not None and plan.compute_dtype == jnp.dtype(jnp.bfloat16)
    hlo = lowered.as_text() if low_compute else ""
    lowered.compile()
    if spec.get("poison") and not prefix:
        phase("poisoned run")
        state = poisoned_step(step, state, batch)
    phase(prefix + "run")
    _self_test(spec.get("self_test"))
    new_state, metrics = step(state, batch)
    jax.block_until_ready((new_state, metrics))
    phase(prefix + "reference")
    static = eqx.filter(state.model, eqx.is_inexact_array, inverse=True)
    ref_model = in_natural_order(eqx.combine(_to_f32(init_params), static))
    kind = spec["model"]["kind"]
    ref_loss_fn = REFERENCE_LOSS.get((kind, spec["loss"]), REFERENCE_LOSS[kind])
    # The first step's reference depends on the model, seed, batch, loss and
    # param_dtype only (cached); a journey's starts from trained parameters.
    cache_key = None
    if not prefix:
        cache_key = json.dumps(
            [spec["model"], spec.get("seed", 0), spec["batch"], str(plan.param_dtype), ref_loss_fn.__name__],
            sort_keys=True,
        )
    ref_loss, ref_grads = reference(
        ref_loss_fn, ref_model, batch, cache_key, whole=whole_batch_reference(spec)
    )
    phase(prefix + "compare")
    captured = in_natural_order(new_state.opt_state[0])
    if spec.get("self_test") == "mismatch":  # the harness's own test: a wrong gradient
        captured = jax.tree.map(lambda g: g * (1 + 1e-4), captured)
    report = compare(
        plan,
        metrics,
        in_natural_order(new_state.model),
        captured,
        in_natural_order(init_params),
        ref_loss,
        ref_grads,
    )
    if low_compute and not _DOT_BF16.search(hlo):
        raise Mismatch("compute_dtype=bfloat16, but no dot_general of the step is in bfloat16")
    if spec.get("skip_nonfinite") and not prefix and bool(metrics["skipped"]):
        raise Mismatch("skip_nonfinite: a step with a finite loss and gradient was skipped")
    return new_state, report


def journey(spec, phase, trained, optim, loss_fn) -> dict:
    """Save the trained state, restore it under the journey's plan: bit for bit the
    trained state in natural order; then (most journeys) one more step under that
    plan, compared with one device from the trained parameters."""
    j = spec["journey"]
    phase("journey save")
    want = _bits(in_natural_order(trained))
    natural = build_model(spec["model"], spec.get("seed", 0))
    with tempfile.TemporaryDirectory(prefix="eqxpar-fuzz-") as tmp:
        with CheckpointManager(os.path.join(tmp, "checkpoints")) as manager:
            manager.save(1, trained)
            manager.wait()
            phase("journey restore")
            plan = build_plan(j)
            like = eqx.filter_eval_shape(eqxpar.train.init, natural, optim, plan, key=jax.random.key(1))
            restored, _ = manager.restore(like=like, plan=plan)
    assert_same_bits(_bits(in_natural_order(restored)), want, "journey: restored under the second plan")
    if not j["step"]:
        return {"restored": "bit-identical"}
    step = eqxpar.train.make_step(loss_fn, optim, plan)
    batch = build_batch(spec, j["batch"]["size"], 2000 + spec.get("seed", 0))
    _, report = step_and_compare(spec, phase, plan, restored, step, batch, prefix="journey ")
    return {"restored": "bit-identical", **report}


def run_example(spec: dict, *, announce: bool = False) -> dict:
    phase = Phases(announce)
    cpu = time.process_time()
    result: dict = {"event": "result", "id": spec.get("id"), "compared": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            phase("build")
            plan, model, loss_fn, batch = build(spec)
            optim = optimizer()
            if spec["model"]["kind"] == "pretrained":
                phase("entry")
                check_entry(spec, model)
            phase("init")
            state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
            extra = {"skip_nonfinite": True} if spec.get("skip_nonfinite") else {}
            step = eqxpar.train.make_step(loss_fn, optim, plan, accumulate=spec.get("accumulate", 1), **extra)
            new_state, result["report"] = step_and_compare(spec, phase, plan, state, step, batch)
            result["compared"] += 1
            if "journey" in spec:
                result["journey"] = journey(spec, phase, new_state, optim, loss_fn)
                result["compared"] += spec["journey"]["step"]
            result["outcome"] = "ok"
        except Mismatch as e:
            result.update(outcome="mismatch", type="Mismatch", message=str(e), phase=phase.name)
        except Exception as e:  # noqa: BLE001 (the point: classify every exception)
            outcome = "eqxpar_error" if isinstance(e, eqxpar.EqxparError) else "other_error"
            result.update(
                outcome=outcome,
                type=f"{type(e).__module__}.{type(e).__qualname__}",
                message=str(e)[:3000],
                phase=phase.name,
            )
            if outcome == "other_error":
                result["traceback"] = "".join(traceback.format_exception(e))[-6000:]
    result["warnings"], result["expected_warnings"] = [], []
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"[:1000]
        if issubclass(w.category, UserWarning) and "Some donated buffers were not usable" in str(w.message):
            continue
        # The workers share one compilation cache (the harness's own speed-up):
        # one may read an entry another is still writing; JAX then compiles
        # afresh and says so. A property of the harness, not of eqxpar.
        if issubclass(w.category, UserWarning) and "Error reading persistent compilation cache" in str(
            w.message
        ):
            continue
        expected = issubclass(w.category, EXPECTED_WARNINGS)
        result["expected_warnings" if expected else "warnings"].append(text)
    result["times"] = phase.close()
    result["cpu"] = round(time.process_time() - cpu, 4)
    return result


# --- A standalone reproducer ---------------------------------------------------------------


def snippet(spec: dict) -> str:
    """Python source that builds and runs the spec's example outside the harness."""
    plan_args = "".join(f", {k}={v}" for k, v in spec["plan"].items())
    mesh_args = ", ".join(f"{k}={v!r}" for k, v in spec["mesh"].items())
    seed = spec.get("seed", 0)
    entry = "model"
    if spec["model"]["kind"] == "pretrained":
        entry = f"eqxpar.models.from_pretrained(W.pretrained_path({spec['model']['name']!r}), plan)"
    skip = ", skip_nonfinite=True" if spec.get("skip_nonfinite") else ""
    poison = ""
    if spec.get("poison"):
        poison = (
            "x = np.array(batch[0]); x.flat[0] = np.nan   # skipped: the state stays as it was\n"
            "state, metrics = step(state, (x, *batch[1:])); print('skipped', bool(metrics['skipped']))\n"
        )
    journey = ""
    if "journey" in spec:
        j = spec["journey"]
        journey = f"""
# Saved, then restored under another plan (the worker compares the restored state, in
# natural order, bit for bit with this one; then trains a step under the new plan).
import tempfile
from eqxpar.checkpoint import CheckpointManager
plan2 = eqxpar.Plan(eqxpar.make_mesh({", ".join(f"{k}={v!r}" for k, v in j["mesh"].items())}){"".join(f", {k}={v}" for k, v in j["plan"].items())})
with tempfile.TemporaryDirectory() as tmp, CheckpointManager(tmp) as manager:
    manager.save(1, state); manager.wait()
    like = eqx.filter_eval_shape(eqxpar.train.init, model, optim, plan2, key=jax.random.key(1))
    restored, _ = manager.restore(like=like, plan=plan2)
batch2 = W.build_batch(W.json.loads({json.dumps(json.dumps(spec))}), {j["batch"]["size"]}, {2000 + seed})
state2, metrics2 = eqxpar.train.make_step(loss_fn, optim, plan2)(restored, batch2)
print("journey loss", float(metrics2["loss"]))
"""
    return f"""\
import sys; sys.path.insert(0, ".")     # run from the repository root
import tests._fuzz_worker as W          # sets XLA_FLAGS (8 CPU devices) before jax; test models
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import eqxpar
from eqxpar import rules
from eqxpar.pipeline import stage_rules

mesh = eqxpar.make_mesh({mesh_args})
plan = eqxpar.Plan(mesh{plan_args})
key, rng = jax.random.key({seed}), np.random.default_rng({1000 + seed})
model = {model_source(spec["model"])}
batch = {batch_source(spec)}
loss_fn = {LOSS_SOURCE[(spec["model"]["kind"], spec["loss"])]}
optim = W.optimizer()                   # keeps the gradient in opt_state[0], then SGD
state = eqxpar.train.init({entry}, optim, plan, key=jax.random.key(1))  # stores the stack in the plan's order
step = eqxpar.train.make_step(loss_fn, optim, plan, accumulate={spec.get("accumulate", 1)}{skip})
{poison}state, metrics = step(state, batch)
print("loss", float(metrics["loss"]), "one device", float(eqx.filter_value_and_grad(loss_fn)(model, batch)[0]))
{journey}"""


def serve() -> None:
    _emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        spec = json.loads(line)
        _emit(run_example(spec, announce=True))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        serve()
    elif argv[:1] == ["--spec"] and len(argv) == 2:
        print(json.dumps(run_example(json.loads(argv[1])), indent=1))
    elif argv[:1] == ["--snippet"] and len(argv) == 2:
        print(snippet(json.loads(argv[1])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
