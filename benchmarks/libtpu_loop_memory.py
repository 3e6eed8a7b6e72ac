"""What the installed libtpu's `memory_analysis()` reports for programs whose layers
run in a `lax.scan`, against the heap its own buffer assignment holds.

`ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -m benchmarks.libtpu_loop_memory [--json PATH]`
compiles, for 4 chips of a v5p slice (from shapes, no chip needed), small programs
over float32 `(d, d)` layers split over the 4 chips: a forward loop (with or without
stacked outputs), its gradient (with the layer rematerialised or not, returned or
consumed by an SGD update), and the same layers unrolled in Python. For each it
prints the temporaries `memory_analysis()` reports, the preallocated temporary heap
of the buffer assignment (`--xla_dump_to`'s `*buffer-assignment.txt`, memory space
0), and their difference. libtpu 0.0.52 reports the heap; 0.0.50.1 (MaxText 0.2.5's)
reports more wherever a loop runs (BENCHMARKS.md, on Llama-3-8B under FSDP 32).
"""

import argparse
import glob
import json
import os
import re
import shutil
import tempfile
from typing import Any

#: (name, layers, width, rows, mode, stacked outputs, remat).
CASES = (
    ("forward", 8, 4096, 1024, "forward", False, False),
    ("forward, rows x2", 8, 4096, 2048, "forward", False, False),
    ("forward, stacked outputs", 8, 4096, 1024, "forward", True, False),
    ("forward, one layer", 1, 4096, 1024, "forward", False, False),
    ("grad, 8 layers", 8, 4096, 1024, "grad", False, False),
    ("grad, 16 layers", 16, 4096, 1024, "grad", False, False),
    ("sgd, 8 layers", 8, 4096, 1024, "sgd", False, False),
    ("sgd, 16 layers", 16, 4096, 1024, "sgd", False, False),
    ("sgd, 8 layers, remat", 8, 4096, 1024, "sgd", False, True),
    ("sgd, 16 layers, remat", 16, 4096, 1024, "sgd", False, True),
    ("grad, 8 layers unrolled", 8, 4096, 1024, "grad-unrolled", False, False),
)

_HEAP = re.compile(r"allocation \d+: size (\d+), page 0, preallocated-temp")


def heap_bytes(dump: str) -> int:
    """The preallocated temporary heap (memory space 0) of the program dumped in `dump`."""
    files = glob.glob(os.path.join(dump, "*buffer-assignment.txt"))
    if len(files) != 1:
        raise RuntimeError(f"expected one buffer assignment in {dump}, found {len(files)}")
    with open(files[0]) as f:
        return sum(int(m.group(1)) for m in map(_HEAP.match, f) if m)


def compile_case(mesh: Any, layers: int, width: int, rows: int, mode: str, ys: bool, remat: bool) -> Any:
    """The compiled program of one case (see `CASES`) on `mesh` (one axis `f`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    split = NamedSharding(mesh, PartitionSpec(None, "f", None))
    w = jax.ShapeDtypeStruct((layers, width, width), jnp.float32, sharding=split)
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("f")))

    def layer(h, wi):
        return jnp.tanh(h @ wi)

    if remat:
        layer = jax.checkpoint(layer)

    def loss(w, h):
        if mode.endswith("unrolled"):
            for i in range(layers):
                h = layer(h, w[i])
            return h.sum()

        def body(h, wi):
            h = layer(h, wi)
            return h, (h if ys else None)

        h, out = jax.lax.scan(body, h, w)
        return h.sum() + (out.sum() if ys else 0.0)

    if mode == "forward":
        return jax.jit(loss).lower(w, x).compile()
    if mode == "sgd":
        fn = lambda w, h: w - 0.1 * jax.grad(loss)(w, h)  # noqa: E731
    else:
        fn = jax.grad(loss)
    return jax.jit(fn, out_shardings=split).lower(w, x).compile()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="libtpu_loop_memory_")
    # Read once, when the backend starts: set before jax is imported.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from benchmarks.tpu_compile import _libtpu_version

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices)[:4], ("f",))
    rows = []
    try:
        for name, *case in CASES:
            temp = compile_case(mesh, *case).memory_analysis().temp_size_in_bytes
            heap = heap_bytes(dump)
            for entry in os.listdir(dump):
                path = os.path.join(dump, entry)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            rows.append({"case": name, "temp_bytes": temp, "heap_bytes": heap, "excess_bytes": temp - heap})
            mib = [f"{n / 2**20:8.2f}" for n in (temp, heap, temp - heap)]
            print(f"{name:28s} temp {mib[0]} MiB  heap {mib[1]}  excess {mib[2]}")
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if args.json:
        versions = {"jax": jax.__version__, "libtpu": _libtpu_version()}
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
