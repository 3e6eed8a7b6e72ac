"""The exceptions eqxpar raises for mistakes it can catch before XLA does.

Every error names the value that was wrong, the value that was expected and the
fix, so that a user never has to decode an XLA partitioner message to find a typo
in a mesh size or an axis name. All of them derive from `EqxparError` (and from
`ValueError`, so code that already catches `ValueError` keeps working).
"""


class EqxparError(ValueError):
    """Base class of every error eqxpar raises on bad input."""


class MeshError(EqxparError):
    """The requested mesh does not fit the available devices."""


class AxisNameError(EqxparError):
    """A rule, spec or annotation names a mesh axis the mesh does not have."""


class SpecError(EqxparError):
    """A PartitionSpec does not fit the array it is applied to (e.g. too long)."""


class DivisibilityError(SpecError):
    """An array dimension is not divisible by the size of the mesh axes it is split over."""


class BatchError(EqxparError):
    """A batch cannot be split over the data-parallel devices or micro-batches."""


class UnmatchedLeafError(EqxparError):
    """A strict path rule met a leaf that none of its patterns match."""


class PlanError(EqxparError):
    """A plan option has a value eqxpar does not support."""


class PipelineScheduleError(PlanError):
    """A pipeline schedule (a table or per-device orders) is not runnable.

    Raised before anything compiles, naming the tick and device (or the devices
    and their blocked actions, for orders that deadlock) and the fix.
    """


class NonFiniteError(EqxparError):
    """A training run keeps producing a non-finite loss or gradient: raised by
    `eqxpar.train.SkipMonitor` after too many consecutive skipped steps."""


class UnusedAxisWarning(UserWarning):
    """A mesh axis larger than 1 splits nothing: neither the batch nor any weight.

    Its devices then compute the same thing (plain replicas), usually because the
    plan's rules claim no weight of a model that has no eqxpar logical axes.
    """


class OffloadWarning(UserWarning):
    """A backend ignores part of a plan's host offload (`Plan(offload=...)`).

    XLA:CPU lowers a remat policy's offloaded activations to plain saves: they
    stay in device memory, and the step computes the same as without the offload.
    Said once per step built, naming the backend, rather than dropped silently.
    """


class AccumulationWarning(UserWarning):
    """A step splits the batch into micro-batches (`accumulate=k`, or a pipeline's
    micro-batches) for a loss that is not a mean over rows, so its gradient is the
    mean of the micro-batches' gradients, not the full batch's.

    Raised for MoE models whose load-balance loss is on (`GPTConfig(
    load_balance_coef != 0)`): that loss is a product of two batch statistics.
    A model of your own says the same of its loss with a method
    `batch_statistic_loss(self) -> tuple[str, str] | None` on any of its modules,
    returning what the term is and how to avoid it (`eqxpar.models.GPT` has one).
    """


class PretrainedError(EqxparError):
    """A Hugging Face checkpoint directory cannot be read into, or written from, an
    `eqxpar.models.GPT`: a missing or damaged file, a tensor whose shape disagrees
    with `config.json`, or a config field eqxpar cannot honour."""
