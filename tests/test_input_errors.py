"""Bad arguments to the plan, the rules and the model config raise eqxpar errors
when the object is built, naming the bad value and the fix, instead of a
TypeError, re.error or ZeroDivisionError from deep inside."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import GPTConfig
from eqxpar.rules import FSDP, MEGATRON, ByPath, Logical, Policy, ZeroShard

from ._helpers import LogicalMLP

GPT_SIZES = dict(vocab_size=96, d_model=64, num_heads=4, num_layers=2, d_hidden=128)


@pytest.fixture(scope="module")
def mesh():
    return eqxpar.make_mesh(data=8)


@pytest.mark.parametrize(
    "fields, error, match",
    [
        # Was a ZeroDivisionError inside the attention layer's constructor.
        (dict(num_kv_heads=0), eqxpar.PlanError, r"num_kv_heads=0\): expected a positive integer"),
        (dict(num_kv_heads=-2), eqxpar.PlanError, r"num_kv_heads=-2\): expected a positive integer"),
        (
            dict(num_kv_heads=3),
            eqxpar.DivisibilityError,
            r"num_heads=4, num_kv_heads=3\).*must divide num_heads\. Use one of \[1, 2, 4\]",
        ),
        # bool is an int subclass; True is not a layer count.
        (dict(num_layers=True), eqxpar.PlanError, r"num_layers=True\): expected a positive integer"),
        (dict(rotary_base=-1.0), eqxpar.PlanError, r"rotary_base=-1\.0\): expected a positive finite"),
        (dict(rotary_base=float("nan")), eqxpar.PlanError, r"rotary_base=nan\): expected a positive finite"),
    ],
    ids=[
        "kv-heads-zero",
        "kv-heads-negative",
        "kv-heads-not-dividing",
        "layers-bool",
        "rotary-base-negative",
        "rotary-base-nan",
    ],
)
def test_gpt_config_checks_every_field(fields, error, match):
    with pytest.raises(error, match=r"GPTConfig\(" + match):
        GPTConfig(**{**GPT_SIZES, **fields})


def test_gpt_config_accepts_grouped_query_heads():
    assert GPTConfig(**GPT_SIZES, num_kv_heads=2).num_kv_heads == 2


@pytest.mark.parametrize(
    "options, error, match",
    [
        (
            dict(annotations={"a": 3}),
            eqxpar.SpecError,
            r"annotations=\.\.\.\) entry 'a': 3 is not a PartitionSpec.*P\(\)",
        ),
        # P(*"data") would be a 4-dimensional spec over axes 'd', 'a', 't', 'a'.
        (
            dict(annotations={"a": "data"}),
            eqxpar.SpecError,
            r"entry 'a': 'data' is a bare string.*P\('data'\)",
        ),
        (dict(annotations=3), eqxpar.PlanError, r"Plan\(annotations=3\): expected a dict"),
        (dict(annotations={1: P()}), eqxpar.PlanError, r"key 1 is not a name"),
        (dict(batch_axes=3), eqxpar.AxisNameError, r"Plan\(batch_axes=3\): expected a mesh axis name"),
        (
            dict(batch_axes=("data", "data")),
            eqxpar.AxisNameError,
            r"batch_axes=\('data', 'data'\)\) names an axis twice",
        ),
        (dict(mode="manual", manual_axes=3), eqxpar.AxisNameError, r"Plan\(manual_axes=3\)"),
        (dict(rules=3), eqxpar.PlanError, r"rules=3 is not a rule; expected an eqxpar\.rules rule"),
        (dict(rules=[MEGATRON, "fsdp"]), eqxpar.PlanError, r"rules='fsdp' is not a rule"),
        # The class has a `spec` attribute, so it used to pass as a rule.
        (dict(rules=FSDP), eqxpar.PlanError, r"rules=FSDP is a rule class.*rules=FSDP\(\.\.\.\)"),
    ],
    ids=[
        "annotation-int",
        "annotation-str",
        "annotations-int",
        "annotation-key-int",
        "batch-axes-int",
        "batch-axes-twice",
        "manual-axes-int",
        "rules-int",
        "rules-list-with-str",
        "rules-class",
    ],
)
def test_plan_rejects_bad_option_values(mesh, options, error, match):
    with pytest.raises(error, match=match):
        eqxpar.Plan(mesh, **options)


def test_plan_takes_one_batch_axis_name(mesh):
    # A bare name used to be split into letters: ('d', 'a', 't', 'a').
    assert eqxpar.Plan(mesh, batch_axes="data").batch_axes == ("data",)


@pytest.mark.parametrize(
    "build, error, match",
    [
        pytest.param(
            lambda: FSDP(axis=1),
            eqxpar.AxisNameError,
            r"rules\.FSDP\(axis=1\): 1 is not a mesh axis",
            id="fsdp-axis-int",
        ),
        pytest.param(
            lambda: FSDP(axis=None), eqxpar.AxisNameError, r"rules\.FSDP\(axis=None\)", id="fsdp-axis-none"
        ),
        pytest.param(lambda: FSDP(axis=()), eqxpar.AxisNameError, r"non-empty tuple", id="fsdp-axis-empty"),
        pytest.param(
            lambda: FSDP(min_size=-1),
            eqxpar.PlanError,
            r"rules\.FSDP: min_size=-1 is not an element count",
            id="fsdp-min-size-negative",
        ),
        pytest.param(lambda: FSDP(min_size="1k"), eqxpar.PlanError, r"min_size='1k'", id="fsdp-min-size-str"),
        pytest.param(
            lambda: ByPath([("[", P())]),
            eqxpar.PlanError,
            r"pattern #0: '\[' is not a valid regular expression",
            id="bypath-bad-regex",
        ),
        pytest.param(
            lambda: ByPath([("w", None)]),
            eqxpar.SpecError,
            r"pattern #0 \('w', None\): None is not a PartitionSpec.*P\(\)",
            id="bypath-spec-none",
        ),
        pytest.param(
            lambda: ByPath([("w", "tensor")]),
            eqxpar.SpecError,
            r"'tensor' is a bare string.*P\('tensor'\)",
            id="bypath-spec-str",
        ),
        pytest.param(
            lambda: ByPath([("w", ("tensor", 3))]),
            eqxpar.AxisNameError,
            r"\('w', spec\): 3 is not a mesh axis",
            id="bypath-spec-entry-int",
        ),
        pytest.param(
            lambda: ByPath([(3, P())]),
            eqxpar.PlanError,
            r"pattern #0: the regex 3 is not a string",
            id="bypath-regex-int",
        ),
        # One pair without its list: iterating it used to unpack "w" into two letters.
        pytest.param(
            lambda: ByPath(("w", P())),
            eqxpar.PlanError,
            r"pattern #0 'w' is not a \(regex, spec\) pair.*in a list",
            id="bypath-pair-without-list",
        ),
        pytest.param(
            lambda: ByPath("w"),
            eqxpar.PlanError,
            r"ByPath\('w'\): expected a list of \(regex, spec\) pairs",
            id="bypath-str",
        ),
        pytest.param(
            lambda: ByPath([("w", P())], strict="yes"),
            eqxpar.PlanError,
            r"strict='yes'\): expected True or False",
            id="bypath-strict-str",
        ),
        pytest.param(
            lambda: Logical("mlp"),
            eqxpar.PlanError,
            r"Logical\('mlp'\): expected a mapping",
            id="logical-str",
        ),
        pytest.param(
            lambda: Logical({1: "tensor"}),
            eqxpar.PlanError,
            r"key 1 is not a logical axis name",
            id="logical-key-int",
        ),
        pytest.param(
            lambda: Policy(3), eqxpar.PlanError, r"Policy\(3\): expected a function", id="policy-not-callable"
        ),
        pytest.param(
            lambda: ZeroShard(3), eqxpar.PlanError, r"rules=3 is not a rule", id="zeroshard-base-int"
        ),
        pytest.param(
            lambda: ZeroShard(MEGATRON, min_size=-5),
            eqxpar.PlanError,
            r"rules\.ZeroShard: min_size=-5",
            id="zeroshard-min-size",
        ),
    ],
)
def test_rule_constructors_reject_bad_arguments(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_policy_result_that_is_not_a_spec_names_the_leaf(mesh):
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    plan = eqxpar.Plan(mesh, rules=Policy(lambda leaf: "data"))
    with pytest.raises(
        eqxpar.SpecError, match=r"Policy\(.*\) for leaf '\.w1' returned: 'data' is a bare string"
    ):
        eqxpar.partition_specs(model, plan)


def test_rules_built_from_lists_stay_hashable(mesh):
    # Plans are hashed (they are static arguments of compiled steps).
    plan = eqxpar.Plan(
        mesh, rules=[ByPath({r"w1$": ["data"]}, strict=False), FSDP(axis=["data"], min_size=1)], zero1=True
    )
    assert hash(plan) == hash(eqxpar.Plan(mesh, rules=list(plan.rules), zero1=True))
    assert plan.rules[0] == ByPath([(r"w1$", P("data"))], strict=False)
    assert plan.rules[1].axis == ("data",)
    assert hash(ZeroShard([MEGATRON], axis=["data"])) == hash(ZeroShard((MEGATRON,), axis=("data",)))


def test_param_and_stacked_axes_must_be_tuples_of_names():
    # A bare string would be read letter by letter as one name per dimension.
    with pytest.raises(eqxpar.SpecError, match=r"axes=\('embed',\)"):
        eqxpar.param(axes="embed")
    with pytest.raises(eqxpar.SpecError, match="got 3"):
        eqxpar.param(axes=("embed", 3))
    with pytest.raises(eqxpar.SpecError, match="leading='stage'"):
        eqxpar.stacked(leading="stage")


def test_stage_rules_axis_must_be_a_name():
    with pytest.raises(eqxpar.PlanError, match=r"stage_rules\(axis=1\)"):
        eqxpar.pipeline.stage_rules(axis=1)


class _StringRule:
    """A user's own rule object whose spec() returns a bare axis name."""

    def spec(self, leaf):
        return "data"


def test_a_custom_rule_returning_a_string_names_the_leaf(mesh):
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    with pytest.raises(eqxpar.SpecError, match=r"leaf \.w1: rule .* returned 'data'"):
        eqxpar.partition_specs(model, eqxpar.Plan(mesh, rules=_StringRule()))


def test_the_tensor_axis_cannot_also_split_the_batch():
    # One mesh axis cannot split both the batch and the features (or sequence) of
    # the tensor-parallel activations (was a DuplicateSpecError when compiling).
    mesh = eqxpar.make_mesh(data=2, tensor=2)
    for kwargs in (dict(rules=MEGATRON), dict(sequence_parallel=True)):
        with pytest.raises(eqxpar.PlanError, match=r"batch over the tensor axis 'tensor' \(size 2\)"):
            eqxpar.Plan(mesh, batch_axes=("data", "tensor"), **kwargs)
    # Even at size 1 (a spec may not name one axis twice: was a DuplicateSpecError).
    with pytest.raises(eqxpar.PlanError, match=r"batch over the tensor axis 'tensor' \(size 1\)"):
        eqxpar.Plan(eqxpar.make_mesh(data=8), batch_axes=("data", "tensor"), rules=MEGATRON)
    # Without tensor parallelism the axis may carry the batch.
    assert eqxpar.Plan(mesh, batch_axes=("data", "tensor")).batch_size_multiple == 4


def test_mesh_sizes_of_the_wrong_type_raise_mesh_error():
    # Under the suite's type-checking hook too (it used to raise its own TypeCheckError).
    with pytest.raises(eqxpar.MeshError, match="4.0"):
        eqxpar.make_mesh(data=4.0)
