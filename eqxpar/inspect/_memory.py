"""Memory per device of a compiled step, from XLA's own memory analysis."""

import dataclasses
from typing import Any

from .._errors import EqxparError
from .._text import fmt_int, render
from ._compiled import as_compiled


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of one compiled executable (`compiled.memory_analysis()`).

    - `argument_bytes`: the inputs (for a step: the state's arrays and the batch).
    - `output_bytes`: the outputs (new state, metrics).
    - `alias_bytes`: outputs written into donated input buffers (counted in both
      of the above, but stored once).
    - `temp_bytes`: scratch the executable allocates while it runs.
    - `generated_code_bytes`: the compiled program itself.

    `total` = arguments + outputs - aliased + temporaries + generated code: the
    bytes the executable needs on each device while it runs. `str(report)` is a
    plain-text table.

    ```python
    report = eqxpar.inspect.memory_report(step, state, batch)
    report.argument_bytes, report.total
    ```
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int

    @property
    def total(self) -> int:
        """Bytes per device while the executable runs (aliased buffers counted once)."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )

    def __str__(self) -> str:
        rows = [
            ["arguments", fmt_int(self.argument_bytes), "state arrays and batch, as passed in"],
            ["outputs", fmt_int(self.output_bytes), "new state and metrics"],
            ["aliased", fmt_int(-self.alias_bytes), "outputs written into donated arguments"],
            ["temporaries", fmt_int(self.temp_bytes), "scratch while running"],
            ["generated code", fmt_int(self.generated_code_bytes), ""],
            ["total", fmt_int(self.total), "per device"],
        ]
        return "memory per device\n" + render(["", "bytes", "what"], rows, right=[False, True, False])


def memory_report(compiled_or_step: Any, *args: Any) -> MemoryReport:
    """The memory each device needs for a compiled step.

    **Arguments:**

    - `compiled_or_step`: an eqxpar `Step` followed by its `(state, batch)` (it is
      compiled for them; nothing runs), or a compiled or lowered computation with
      no further arguments: `jax.jit(f).lower(...)` or `eqx.filter_jit(f).lower(...)`,
      with or without `.compile()`.

    **Returns:** a `MemoryReport` (`argument_bytes`, `output_bytes`, `alias_bytes`,
    `temp_bytes`, `generated_code_bytes`, `total`); `str(report)` is a table.

    **Raises:** `EqxparError` for an argument of the wrong kind or number, or when
    the backend reports no memory analysis.

    ```python
    print(eqxpar.inspect.memory_report(step, state, batch))
    ```
    """
    compiled, _ = as_compiled(compiled_or_step, args, where="memory_report")
    stats = compiled.memory_analysis()
    if stats is None:
        raise EqxparError(
            "memory_report: this backend's compiled executable has no memory analysis "
            "(compiled.memory_analysis() returned None); there is nothing to report on it."
        )
    return MemoryReport(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
    )
