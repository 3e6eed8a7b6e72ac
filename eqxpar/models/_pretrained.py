"""`from_pretrained` / `save_pretrained`: Hugging Face checkpoint directories
(config.json + safetensors) read straight into a plan's sharding, and written
back one tensor at a time."""

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, make_single_device_sharding

from .._errors import PretrainedError
from .._plan import Plan
from .._sharding import named_shardings
from .._stack_order import in_natural_order, in_plan_order
from ..nn._stack import Stacked
from ._gpt import GPT
from ._hf_config import config_from_hf, config_to_hf, infer_model_type
from ._hf_files import (
    CONFIG,
    DTYPE_NAMES,
    INDEX,
    SINGLE,
    TensorFiles,
    read_config,
    safetensors_module,
    write_safetensors,
)
from ._hf_layout import Source, layout

# Tensors transformers keeps on disk that are not weights (old GPT-2 files carry
# the causal-mask buffers; some Llama files the rotary frequencies).
_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _leaf_sources(config, kind: str, prefix: str) -> tuple[Any, list]:
    # The model's outline only: eval_shape draws no random weights.
    abstract = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    sources = layout(config, kind, prefix)
    paths = jax.tree_util.tree_flatten_with_path(abstract)[0]
    missing = [jax.tree_util.keystr(p) for p, leaf in paths if jax.tree_util.keystr(p) not in sources]
    if missing:  # a GPT field with no place in this architecture: a bug, not bad input
        raise PretrainedError(f"eqxpar has no Hugging Face {kind!r} name for {missing}.")
    return abstract, [(p, leaf, sources[jax.tree_util.keystr(p)]) for p, leaf in paths]


def _check_tensors(files: TensorFiles, leaves: list, kind: str) -> None:
    wanted: set[str] = set()
    for path, leaf, source in leaves:
        for _, name in source.names(leaf.shape):
            wanted.add(name)
            shape = files.shape(name)
            if shape != source.tensor_shape:
                raise PretrainedError(
                    f"from_pretrained: tensor {name!r} in {files.file_of[name]!r} has shape {shape}, but "
                    f"config.json ({kind}) implies {source.tensor_shape} for it (eqxpar leaf "
                    f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)}). The weights and config.json come "
                    "from different models: use the config.json of these weights."
                )
            if not files.dtype_name(name).startswith(("F", "BF")):
                raise PretrainedError(
                    f"from_pretrained: tensor {name!r} in {files.file_of[name]!r} is "
                    f"{files.dtype_name(name)}; expected floating-point weights (quantised checkpoints "
                    "are not supported)."
                )
    extra = sorted(n for n in files.names() - wanted if not n.endswith(_BUFFERS))
    if extra:
        raise PretrainedError(
            f"from_pretrained: {len(extra)} tensors of the checkpoint have no place in the {kind!r} model "
            f"config.json describes, e.g. {extra[:3]}. Loading would drop them and give a different "
            "model; check that config.json belongs to these weights."
        )


def from_pretrained(
    path: str | os.PathLike, plan: Plan | None = None, *, dtype: Any = None, loss_chunk: int | None = None
) -> GPT:
    """Load a Hugging Face checkpoint directory as an `eqxpar.models.GPT`.

    Reads `config.json` and the safetensors weights (`model.safetensors`, or the
    shards listed in `model.safetensors.index.json`) of a Llama (2, 3, 3.1 with
    llama3 `rope_scaling`), Mistral, Qwen2, Mixtral or GPT-2 model. Every
    config.json field is honoured exactly or refused (`eqxpar.PretrainedError`
    naming it): a sliding window shorter than the context, unknown rope scalings,
    other architectures. Only safetensors are read (a `pytorch_model.bin` is a
    pickle, and loading one runs code). Dropout rates are not carried: the GPT has
    no dropout.

    With a `plan`, every array is read straight into the sharding the plan's rules
    give it (the same as `eqxpar.shard` and `eqxpar.train.init` give): each
    process reads from disk only the blocks its own devices hold (only its layers'
    tensors, only its rows), so no host ever holds the whole model.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `plan`: an `eqxpar.Plan` to shard the model by; None puts it on one device.
    - `dtype`: the dtype of the weights (keyword-only; e.g. `jnp.bfloat16`);
      default None keeps each tensor's stored dtype.
    - `loss_chunk`: the model's `GPTConfig.loss_chunk` (keyword-only; default
      None): how `lm_loss` runs, not part of the checkpoint, so config.json has no
      field for it (e.g. 1024 for a Llama 3 vocabulary of 128,256 ids).

    **Returns:** the `GPT`; its `config` reproduces the checkpoint's model.

    ```python
    model = eqxpar.models.from_pretrained("Llama-3.2-1B", plan)
    state = eqxpar.train.init(model, optax.adamw(1e-5), plan, key=jax.random.key(0))
    ```
    """
    directory = pathlib.Path(path)
    if plan is not None and not isinstance(plan, Plan):
        raise PretrainedError(f"from_pretrained(plan={plan!r}): expected an eqxpar.Plan or None.")
    config, kind = config_from_hf(read_config(directory))
    if loss_chunk is not None:
        config = dataclasses.replace(config, loss_chunk=loss_chunk)
    files = TensorFiles(directory)
    prefix = "transformer." if kind == "gpt2" and "transformer.wte.weight" in files.names() else ""
    abstract, leaves = _leaf_sources(config, kind, prefix)
    _check_tensors(files, leaves, kind)
    # The plan owns the layer order: a pipeline's stack is read straight into the
    # rows it stores (each device still reads only its own layers' tensors).
    stored = abstract if plan is None else in_plan_order(abstract, plan)
    shardings = None if plan is None else named_shardings(stored, plan)
    device = make_single_device_sharding(jax.local_devices()[0])
    arrays = []
    sharding_leaves = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    for (_, leaf, source), sharding, rows in zip(leaves, sharding_leaves, _row_maps(stored), strict=True):
        arrays.append(_load_leaf(files, source, leaf, sharding or device, dtype, rows))
    return jax.tree.unflatten(jax.tree.structure(stored), arrays)


def _row_maps(tree: Any) -> list[np.ndarray | None]:
    """For every array leaf of `tree`: the natural layer each stored row holds
    (-1: padding) where it is part of a stack stored in another order, else None."""

    out: list[np.ndarray | None] = []
    for node in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, Stacked)):
        if isinstance(node, Stacked):
            rows = None if node.order is None else node.order.rows()
            out += [rows] * len(jax.tree.leaves(node))
        else:
            out.append(None)
    return out


def _stored_dtype(files: TensorFiles, source: Source, shape: tuple[int, ...]) -> Any:
    names = source.names(shape)
    if not names:
        return np.float32
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    return by_name[files.dtype_name(names[0][1])]


def _load_leaf(
    files: TensorFiles, source: Source, leaf: Any, sharding: Any, dtype: Any, rows: np.ndarray | None
) -> jax.Array:
    """`leaf` (natural order) read into `sharding`; with `rows`, stored in that
    row order (`rows[r]`: the layer at stored row `r`, -1 a padding row of zeros)."""
    natural = tuple(leaf.shape)
    shape = natural if rows is None else (len(rows), *natural[1:])
    target = np.dtype(dtype) if dtype is not None else _stored_dtype(files, source, natural)
    cache: dict[tuple, np.ndarray] = {}

    def read(ranges: tuple) -> np.ndarray:
        # Devices that hold the same block (replicas) share one read.
        if ranges not in cache:
            cache[ranges] = source.read(files, natural, ranges, target)
        return cache[ranges]

    def block(index: tuple[slice, ...]) -> np.ndarray:
        ranges = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if rows is None:
            return read(ranges)
        parts = [
            read(((int(rows[r]), int(rows[r]) + 1), *ranges[1:]))
            if rows[r] >= 0
            else np.zeros([1, *(b - a for a, b in ranges[1:])], target)
            for r in range(*ranges[0])
        ]
        return np.concatenate(parts)

    return jax.make_array_from_callback(shape, sharding, block)


def _host_part(x: jax.Array, combo: tuple[int, ...], enum: tuple[int, ...]) -> np.ndarray:
    # One tensor's part of a leaf, gathered whole and replicated on every device
    # (every process can then read it; only that tensor ever travels).
    if not enum:
        part = _replicated(x)
    else:
        part = _pick(x, jnp.asarray(combo, jnp.int32), enum)
    return np.asarray(jax.device_get(part))


def host_array(x: jax.Array) -> np.ndarray:
    """`x` whole on the host of every process (a gather where it is spread over
    processes); shared with `save_lora`."""
    return np.asarray(jax.device_get(_replicated(x)))


def _replicated(x: jax.Array) -> jax.Array:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or x.is_fully_addressable:
        # This process holds every shard: `device_get` assembles the tensor on the
        # host with no collective and nothing to compile. (Fully addressable or not
        # is the same answer on every process, so all take part in a gather or none.)
        return x
    return _replicate_on(sharding.mesh)(x)


@functools.cache
def _replicate_on(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    # One jitted identity per mesh: its compiled programs are reused for every
    # tensor of the same shape (a new jit per call compiled once per tensor).
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))


@eqx.filter_jit
def _pick_jit(x: jax.Array, combo: jax.Array, enum: tuple[int, ...]) -> jax.Array:
    index = tuple(combo[enum.index(d)] if d in enum else slice(None) for d in range(x.ndim))
    return x[index]


def _pick(x: jax.Array, combo: jax.Array, enum: tuple[int, ...]) -> jax.Array:
    return _replicated(_pick_jit(x, combo, enum))


def save_pretrained(
    model: GPT,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    model_type: str | None = None,
) -> None:
    """Write `model` as a Hugging Face checkpoint directory that `from_pretrained`
    and transformers (`AutoModelForCausalLM.from_pretrained`) read back exactly.

    Writes `config.json` and `model.safetensors`, or, past `max_shard_bytes`,
    `model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json`.
    The model may be sharded under any plan, over several processes: each Hugging
    Face tensor is gathered to the hosts on its own and written before the next, so
    no host holds more than one tensor (process 0 writes; every process must call
    this). The architecture follows from the config: learned positions -> GPT-2, MoE
    -> Mixtral, Q/K/V biases only -> Qwen2, else Llama (`model_type="mistral"`
    writes a Llama-shaped model as Mistral); a config no architecture has (e.g.
    `moe_every=2`) raises `eqxpar.PretrainedError` naming the field. Training-loss
    settings transformers has no field for (`router_z_coef`, `loss_chunk`) are not
    written.

    **Arguments:**

    - `model`: an `eqxpar.models.GPT`.
    - `path`: the directory to write (created if missing).
    - `max_shard_bytes`: largest safetensors file (keyword-only; default 5 GiB).
    - `model_type`: the Hugging Face `model_type` to write (keyword-only; default
      None: inferred as above).

    **Returns:** None.

    ```python
    eqxpar.models.save_pretrained(state.model, "finetuned", max_shard_bytes=2 * 2**30)
    ```
    """
    if not isinstance(model, GPT):
        raise PretrainedError(
            f"save_pretrained(model={type(model).__name__}): expected an eqxpar.models.GPT."
        )
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise PretrainedError(
            f"save_pretrained(max_shard_bytes={max_shard_bytes!r}): expected a positive integer."
        )
    safetensors_module()
    # Written in natural order whatever order a plan stores the stack in (the
    # stack records it): layer i under the name of layer i.
    model = in_natural_order(model)
    config = model.config
    kind = infer_model_type(config) if model_type is None else model_type
    flat = jax.tree_util.tree_flatten_with_path(model)[0]
    if any(".lora." in jax.tree_util.keystr(p) for p, _ in flat):
        raise PretrainedError(
            "save_pretrained: the model has low-rank adapters, which a Hugging Face checkpoint has no "
            "place for. Fold them in first (eqxpar.models.merge_lora(model)), or write them on their "
            "own for PEFT (eqxpar.models.save_lora)."
        )
    sources = layout(config, kind, "transformer." if kind == "gpt2" else "")
    leaves = {jax.tree_util.keystr(p): leaf for p, leaf in flat if eqx.is_array(leaf)}
    dtypes = {np.dtype(leaf.dtype) for leaf in leaves.values()}
    hf = config_to_hf(config, kind, _torch_dtype(max(dtypes, key=lambda d: d.itemsize)))
    # Every tensor: its contributions (leaf, source, enumerated index), in file order.
    tensors: dict[str, list] = {}
    for key, leaf in leaves.items():
        source = sources[key]
        if source.zeros:
            if np.any(np.asarray(jax.device_get(_replicated(leaf)))):
                raise PretrainedError(
                    f"save_pretrained: {key} is not zero, and Hugging Face {kind!r} has no tensor for it "
                    "(a router bias moved by eqxpar.nn.update_router_bias). Transformers would drop it."
                )
            continue
        for combo, name in source.names(tuple(leaf.shape)):
            tensors.setdefault(name, []).append((leaf, source, combo))
    shapes = {name: parts[0][1].tensor_shape for name, parts in tensors.items()}
    types = {name: np.dtype(parts[0][0].dtype) for name, parts in tensors.items()}
    files = _plan_files(tensors, shapes, types, max_shard_bytes)

    def fetch(name: str) -> np.ndarray:
        out = np.zeros(shapes[name], types[name])
        for leaf, source, combo in tensors[name]:
            source.place(out, _host_part(leaf, combo, source.enum))
        return out

    directory = pathlib.Path(path)
    writer = jax.process_index() == 0
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    for file, names in files.items():
        specs = [(name, shapes[name], types[name]) for name in names]
        if writer:
            write_safetensors(directory / file, specs, fetch)
        else:
            for name in names:  # the gathers are collective: take part in each
                fetch(name)
    if writer and len(files) > 1:
        total = sum(int(np.prod(shapes[n])) * types[n].itemsize for n in shapes)
        weight_map = {name: file for file, names in files.items() for name in names}
        (directory / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )


def _torch_dtype(dtype: np.dtype) -> str:
    return {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64"}[
        dtype.name
    ]


def _plan_files(tensors: dict, shapes: dict, types: dict, max_bytes: int) -> dict[str, list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in tensors:
        nbytes = int(np.prod(shapes[name])) * types[name].itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}
