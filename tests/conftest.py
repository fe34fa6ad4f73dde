"""The suite plans afresh: a plan cached by one test (``autotp.planner.cache``) would hide
what another test changes (a monkeypatched search, a narrower beam). tests/test_cache.py
turns the cache on, in a temporary directory."""

import os

import pytest

os.environ["AUTOTP_CACHE"] = "0"


# ---- the slow tier -----------------------------------------------------------------------
# `python -m pytest -q` runs the default tier (about 15 minutes on 2 cores); the tests named
# below carry the ``slow`` marker and run with `python -m pytest -q -m slow` (CI, .ci/run,
# runs both). They are the slowest in a full run on a 2-core CPU (`--durations=0`, setup
# included: the seconds beside each), down to about 9 s, which leaves the default tier about
# 11 minutes of tests. Regenerate from such a run when the suite changes.
SLOW: dict[str, float] = {
    "tests/test_benchmarks.py::test_counter_sees_what_autotp_logs[False]": 10,
    "tests/test_checkpoint.py::test_bad_inputs_are_clear_errors": 31,
    "tests/test_checkpoint.py::test_blocks_held_whole_move_between_tp": 50,
    "tests/test_checkpoint.py::test_from_pretrained_matches_transformers[2]": 39,
    "tests/test_checkpoint.py::test_from_pretrained_matches_transformers[4]": 66,
    "tests/test_checkpoint.py::test_from_pretrained_passes_options_through": 15,
    "tests/test_checkpoint.py::test_generate_follows_the_checkpoints_generation_config": 23,
    "tests/test_checkpoint.py::test_init_equals_the_unsharded_initialization[gpt2]": 11,
    "tests/test_checkpoint.py::test_init_equals_the_unsharded_initialization[tiny]": 9,
    "tests/test_checkpoint.py::test_loading_reads_slices_not_the_whole_model": 22,
    "tests/test_checkpoint.py::test_resume_at_another_tp_follows_uninterrupted_training[llama]": 46,
    "tests/test_checkpoint.py::test_resume_at_another_tp_follows_uninterrupted_training[phi3_gqa]": 39,  # noqa: E501
    "tests/test_checkpoint.py::test_resume_moves_experts_between_ep_and_tp": 50,
    "tests/test_checkpoint.py::test_resume_upward_fills_each_ranks_slices": 59,
    "tests/test_checkpoint.py::test_save_pretrained_loads_bitwise_in_transformers[gpt2]": 12,
    "tests/test_checkpoint.py::test_save_pretrained_loads_bitwise_in_transformers[qwen3_moe]": 17,
    "tests/test_checkpoint.py::test_save_pretrained_writes_experts_as_the_checkpoint_stored_them": 47,  # noqa: E501
    "tests/test_cli.py::test_plan_json_matches_the_reviewed_golden_plan_and_is_deterministic": 28,
    "tests/test_cli.py::test_python_m_and_console_script_agree": 11,
    "tests/test_composition.py::test_fsdp2_per_layer_on_a_2d_mesh": 40,
    "tests/test_distributed.py::test_gloo_loss_computed_by_the_model": 19,
    "tests/test_distributed.py::test_gloo_processes_match_unsharded[2]": 20,
    "tests/test_distributed.py::test_gloo_processes_match_unsharded[4]": 37,
    "tests/test_estimate.py::test_bad_input_is_refused_with_the_numbers": 10,
    "tests/test_estimate.py::test_cli_estimate_writes_the_schema": 14,
    "tests/test_estimate.py::test_expert_products_are_timed_at_the_busiest_rank": 29,
    "tests/test_estimate.py::test_float32_inside_a_bfloat16_model_counts_four_bytes": 17,
    "tests/test_coalesce.py::test_deepseek_routing_weights_join_the_experts_input_gradient": 15,
    "tests/test_estimate.py::test_expert_parallelism_bad_input_is_refused_with_the_numbers": 8,
    "tests/test_estimate.py::test_expert_parallelism_is_searched_and_priced": 30,
    "tests/test_experts.py::test_experts_whole_exact[2-learned-2]": 9,
    "tests/test_experts.py::test_published_moe_shape_on_meta[DeepSeek-V3]": 20,
    "tests/test_experts.py::test_generate_with_experts_whole": 92,
    "tests/test_experts.py::test_gloo_expert_parallel_with_fsdp2_and_in_pipeline_stages": 120,
    "tests/test_families.py::test_gloo_mixtral_matches_the_unsharded_model": 16,
    "tests/test_fusion.py::test_compiled_program_matches_the_unsharded_model[sp]": 35,
    "tests/test_fusion.py::test_compiled_program_matches_the_unsharded_model[tp]": 22,
    "tests/test_fusion.py::test_inductor_compiled_program_matches_the_unsharded_model": 63,
    "tests/test_generate.py::test_automatic_dims_when_export_refuses_named_ones": 10,
    "tests/test_generate.py::test_beam_search_and_generate_outputs": 16,
    "tests/test_generate.py::test_cache_keeps_the_heads_a_rank_reads": 15,
    "tests/test_generate.py::test_generate_in_processes[2-names0]": 42,
    "tests/test_generate.py::test_generate_in_processes[4-names1]": 47,
    "tests/test_generate.py::test_generate_with_a_pad_token_and_no_length": 10,
    "tests/test_generate.py::test_greedy_at_tp4[bigcode]": 14,
    "tests/test_generate.py::test_greedy_at_tp4[bloom]": 17,
    "tests/test_generate.py::test_greedy_at_tp4[gpt2]": 14,
    "tests/test_generate.py::test_greedy_at_tp4[qwen2]": 17,
    "tests/test_lint.py::test_mypy_on_the_typed_core": 25,
    "tests/test_peers.py::test_diffusers_dit[2]": 14,
    "tests/test_peers.py::test_diffusers_dit[4]": 14,
    "tests/test_peers.py::test_diffusers_flux_double_and_single_stream_blocks_at_megatrons_count": 43,  # noqa: E501
    "tests/test_peers.py::test_diffusers_pixart_with_a_dict_of_none[2]": 14,
    "tests/test_peers.py::test_diffusers_pixart_with_a_dict_of_none[4]": 11,
    "tests/test_peers.py::test_diffusers_sd3_joint_blocks_at_megatrons_count[2]": 18,
    "tests/test_peers.py::test_diffusers_sd3_joint_blocks_at_megatrons_count[4]": 18,
    "tests/test_peers.py::test_peft_lora_llama_traces_without_its_cache": 9,
    "tests/test_peers.py::test_peft_lora_on_every_linear_costs_no_collective[2]": 9,
    "tests/test_peers.py::test_peft_lora_on_every_linear_costs_no_collective[4]": 10,
    "tests/test_pipeline.py::test_pipeline_matches_the_unsharded_model": 53,
    "tests/test_pipeline.py::test_pipeline_with_fsdp_on_a_3d_mesh": 65,
    "tests/test_pipeline.py::test_stages_read_only_their_weights": 30,
    "tests/test_random_models.py::test_drawn_configuration_classes_really_shard[generic-moe-stacked-einsum-top2-qknorm-inplace-tp4]": 15,  # noqa: E501
    "tests/test_random_models.py::test_generic_models_match_or_refuse": 95,
    "tests/test_random_models.py::test_sequence_parallel_models_match_or_refuse": 45,
    "tests/test_random_models.py::test_transformers_models_match_or_refuse": 45,
    "tests/test_regather.py::test_saved_activations_hold_shards_not_gathered_inputs[gpt2]": 11,
    "tests/test_regather.py::test_saved_activations_hold_shards_not_gathered_inputs[llama]": 14,
    "tests/test_repeat.py::test_coverage_families_traced_once_plan_as_traced_in_full[Falcon]": 13,
    "tests/test_robustness.py::test_a_bfloat16_model_solves_each_repeated_layer_once": 12,
    "tests/test_robustness.py::test_a_failing_rank_makes_the_others_fail_fast": 14,
    "tests/test_robustness.py::test_an_example_of_batch_one_plans_as_any_batch": 11,
    "tests/test_robustness.py::test_norm_over_sharded_heads_takes_partial_statistics": 17,
    "tests/test_robustness.py::test_partial_statistics_leave_megatron_plans_alone": 10,
    "tests/test_robustness.py::test_plans_load_from_json_only": 9,
    "tests/test_robustness.py::test_ranks_seeded_differently_are_refused": 12,
    "tests/test_robustness.py::test_ranks_with_different_models_fail_with_the_plan_check": 11,
    "tests/test_robustness.py::test_values_of_the_inputs_alone_are_computed_replicated": 21,
    "tests/test_vocab_sequence.py::test_gloo_processes_match[2-sp]": 13,
    "tests/test_vocab_sequence.py::test_gloo_processes_match[2-tp]": 15,
    "tests/test_vocab_sequence.py::test_gloo_processes_match[4-sp]": 42,
    "tests/test_vocab_sequence.py::test_gloo_processes_match[4-tp]": 30,
    "tests/test_vocab_sequence.py::test_plan_json_and_table_show_sequence_parallelism": 9,
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SLOW or item.nodeid.split("::")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
