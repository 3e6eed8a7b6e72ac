"""Cases kept out of `make test` for time (marked `slow` by tests/conftest.py;
`make test-slow` and CI run them), each beside the sibling in `make test` that
runs the same code path: another size of the same mesh, another plan of the
same mode, the same example script with other flags, the same schedule at a
smaller pipe. tests/test_slow_cases.py holds each entry to a real case and a
sibling that `make test` runs.

Cases slow for a reason of their own (the deep fuzz, the random-fault restarts)
carry `@pytest.mark.slow` where they are defined instead.
"""

#: node id of a case `make test` leaves out -> node id of its sibling in `make test`.
SLOW_CASES: dict[str, str] = {}


def _add(test: str, sibling_of: dict[str, str]) -> None:
    for case, sibling in sibling_of.items():
        SLOW_CASES[f"tests/{test}[{case}]"] = f"tests/{test}[{sibling}]"


# The examples: each script runs in `make test` under one plan of its table; the
# others differ in flags whose code paths the parity tests run.
_add(
    "test_examples.py::test_example_runs",
    {
        "data/manual": "data/auto",
        "tensor/auto": "tensor/sp",
        "tensor/sync": "tensor/sp",
        "tensor/overlap": "tensor/sp",
        "tensor/partial": "tensor/sp",
        "fsdp/fsdp": "fsdp/hsdp",
        "fsdp/zero1": "fsdp/hsdp",
        "hybrid/auto": "hybrid/manual",
        "hybrid/partial": "hybrid/manual",
        "context/allgather": "context/ring",
        "context/tensor": "context/ring",
        "demo/no-pipeline": "demo/3d",
        "vit/auto": "vit/sp",
    },
)
# Tensor-parallel layers: every mode at tensor 2 (and automatic at 8) in make test.
_add(
    "test_nn.py::test_every_layer_matches_dense",
    {
        "auto-4": "auto-2",
        "sync-4": "sync-2",
        "sync-8": "sync-2",
        "sp-4": "sp-2",
        "sp-8": "sp-2",
        "overlap-4": "overlap-2",
        "overlap-8": "overlap-2",
    },
)
# Each schedule at pipe 2 (1F1B at 4 too) in make test.
_add(
    "test_pipeline.py::test_pipeline_matches_sequential",
    {
        "gpipe-v1-p4-m16": "gpipe-v1-p2-m4",
        "interleaved-v1-p4-m8": "interleaved-v1-p2-m2",
        "interleaved-v2-p4-m16": "interleaved-v2-p2-m4",
        "zero_bubble-v1-p4-m4": "zero_bubble-v1-p2-m8",
        "zb_v-p4-m4": "zb_v-p2-m4",
    },
)
_add(
    "test_pipeline.py::test_uneven_stages_train_like_one_device",
    {"zero_bubble-v1-p4": "1f1b-v1-p4", "dualpipe_v-v2-p2": "zb_v-v2-p2"},
)
_add(
    "test_pipeline.py::test_each_device_sends_only_what_it_must",
    {"interleaved-2": "1f1b-1", "zero_bubble-1": "gpipe-1", "zb_v-2": "1f1b-1"},
)
_add("test_pipeline.py::test_memory_flat_from_4p_to_16p_microbatches", {"zero_bubble-1": "1f1b-1"})
_add("test_pipeline.py::test_lockstep_flops_are_the_tables", {"interleaved-4-8-2": "interleaved-2-4-2"})
_add("test_pipeline.py::test_head_aware_loss_under_every_schedule", {"gpipe-1": "zero_bubble-1"})
_add(
    "test_x64.py::test_pipeline_schedules_under_x64_match_one_device",
    {"1f1b-v1-p4-d1": "1f1b-v1-p2-d2"},
)
_add("test_expert_parallel.py::test_expert_and_pipeline_axes_match_one_device", {"gpipe": "1f1b"})
# Context parallelism: each attention and mode once.
_add(
    "test_context_parallel.py::test_gpt_matches_single_device",
    {"ring-manual": "fsdp-manual", "tensor-auto": "tensor-sp", "ulysses-auto": "ulysses-gqa-data"},
)
_add(
    "test_context_attention.py::test_matches_dense_attention_forward_and_backward",
    {"4-ring-True-True": "2-ring-True-True", "4-allgather-True-True": "2-allgather-True-True"},
)
_add(
    "test_attention_segments.py::test_context_attention_equals_dense",
    {"True-True-ring": "False-True-ring", "True-True-allgather": "False-True-allgather"},
)
_add(
    "test_attention_dropout.py::test_attention_dropout_in_a_context_step",
    {"ring-data": "allgather-tensor-sp"},
)
_add(
    "test_context_parallel.py::test_wire_bytes_against_the_library_minimum",
    {"allgather-sizes0-options0": "allgather-sizes1-options1"},
)
# FSDP, tensor parallelism, models.
_add(
    "test_fsdp.py::test_stacked_model_matches_single_device_over_steps",
    {
        "dp_fsdp_tp_auto_remat": "dp_fsdp_tp_partial",
        "fsdp_manual_remat_full": "fsdp_manual",
        "zero1_manual": "zero1_auto",
    },
)
_add("test_fsdp.py::test_bfloat16_compute_stays_close_to_float32", {"auto": "manual"})
_add("test_minimum.py::test_fsdp_gathers_once_when_kept_and_again_under_remat", {"none-1": "inputs-2"})
_add(
    "test_models.py::test_gpt_loss_and_gradients_match_single_device",
    {
        "fsdp-tp-auto-remat-full": "tp-sp-remat-full",
        "whole-vocab-auto": "whole-vocab-auto-sp",
        "whole-vocab-sync": "whole-vocab-sp",
    },
)
_add(
    "test_tp_step.py::test_tp_step_matches_single_device",
    {
        "partial_overlap-d2t4-acc2": "partial_overlap-d2t4-acc1",
        "sp-d2t4-acc2": "sp-d2t4-acc1",
        "overlap-d4t2-acc1": "overlap-d2t4-acc1",
    },
)
_add(
    "test_tp_step.py::test_partial_manual_keeps_the_batch_split_and_reductions_out_of_loops",
    {"overlap": "sync"},
)
_add("test_moe_gpt.py::test_stacked_returns_aux_stacked_over_layers", {"none": "dots", "full": "dots"})
_add("test_moe_gpt.py::test_moe_gpt_matches_one_device", {"data8": "expert4_data2"})
_add("test_vision_transformer.py::test_matches_single_device_without_dropout", {"auto-first": "auto-mean"})
_add("test_vision_transformer.py::test_dropout", {"auto": "sp"})
# A rank that dies stops the run: by an exception and by SIGKILL in make test.
_add(
    "test_launch.py::test_a_rank_failing_after_initialize_stops_the_run",
    {
        "exit7-1-exited with status 7": "raise-0-exited with status 1",
        "SIGTERM-1-was killed by signal SIGTERM": "SIGKILL-1-was killed by signal SIGKILL",
    },
)


# LoRA: each mode's sequence-parallel or overlapped variant beside a plan of the same mode.
_add(
    "test_lora.py::test_adapted_model_trains_as_one_device_with_only_its_own_collectives",
    {"tp-manual": "tp-manual-sp", "tp-overlap": "tp-manual-sp", "tp-auto-sp": "fsdp-tp"},
)
# Frozen weights and evaluation: the manual-region path runs in make test under
# FSDP (and tensor) plans; the expert and context plans take the same path.
_add(
    "test_frozen.py::test_frozen_weights_stay_and_the_rest_trains_like_one_device",
    {"expert-data": "fsdp-manual-accumulate", "context-allgather": "tensor-sp-manual"},
)
_add(
    "test_eval.py::test_eval_loss_is_the_one_device_loss_of_every_row",
    {
        "expert": "fsdp-manual",
        "context-allgather": "tensor-sp-manual",
        "pipeline-interleaved": "pipeline-zb_v",
    },
)
# LoRA under the other plans: manual FSDP (the adapters gathered per layer in the
# stack's scan) and 1F1B over uneven stages (the adapters padded to a stage's slots)
# in make test; context and expert plans take the same manual-region path, the
# other pipeline placements the same engine.
_add(
    "test_lora.py::test_lora_trains_as_one_device_under_manual_fsdp_context_expert_and_pipeline_plans",
    {"context": "fsdp-manual", "expert": "fsdp-manual", "interleaved": "1f1b-uneven", "zb_v": "1f1b-uneven"},
)
