"""The training step, a private package (README.md): the plan resolved once
(`_resolved_plan`), laid out over the state (`_step_layout`), and compiled
(`_step`, `_eval`, the gradient implementations). `eqxpar.train` re-exports its
public names."""
