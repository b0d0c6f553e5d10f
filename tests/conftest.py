"""Test set-up: Keras on JAX with 8 emulated CPU devices, before JAX starts."""

import os

os.environ["KERAS_BACKEND"] = "jax"
# XLA:CPU's LLVM backend at optimisation level 0: the tests' steps are tiny, so compiling them
# dominates the suite's time, and level 0 compiles a third faster (MobileNetV3Small's sharded and
# one-device `fit`: 71 s -> 47 s). It changes only the machine code XLA:CPU emits for each fused
# kernel: the HLO passes, the collectives the tests count and the buffer assignment whose memory
# they read are the same (and XLA:TPU's compiles, which ignore it, report the same figures). The
# processes the tests start inherit it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

import gc
import shutil
import tempfile

import jax
import keras
import pytest

import keras_meshlayout as kml

kml.emulate_devices(8)

# The processes the tests start (recipes, killed and resumed trainings, launched jobs, the command
# line) compile the same small training steps again and again: they share JAX's persistent
# compilation cache, one directory per test session, made by the first process (pytest, or xdist's
# controller, whose environment the workers inherit) and removed when it ends. Every entry is
# kept (no minimum compile time), and the cache is locked as processes write to it in parallel
# (a maximum size turns the lock on). The test processes themselves compile afresh: what they read
# of a compiled step (its HLO, its memory) is never read back from a cache. (A step compiled for
# libtpu's compile-only TPU devices is written to the cache but cannot be read back: JAX warns,
# "PjRtCompiler must be constructed with a Client"; no two processes the tests start compile the
# same TPU step, and the test processes compile theirs without the cache.)
_COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR"
_OWN_COMPILE_CACHE = _COMPILE_CACHE not in os.environ
if _OWN_COMPILE_CACHE:
    os.environ[_COMPILE_CACHE] = tempfile.mkdtemp(prefix="kml-tests-compile-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 * 2**30)
jax.config.update("jax_enable_compilation_cache", False)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process that made the compilation cache removes it."""
    if _OWN_COMPILE_CACHE:
        shutil.rmtree(os.environ[_COMPILE_CACHE], ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_global_distribution():
    """Each test starts and ends without a global Keras distribution."""
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


@pytest.fixture(autouse=True)
def _freeze_what_the_test_left():
    """After each test, what it left alive is collected once and frozen out of later collections.

    Keras's `Layer.__delattr__` runs a full `gc.collect()` for every variable a layer drops, and
    `model.quantize(...)` drops every kernel it replaces: in a worker that has run a few hundred
    tests, each such collection walked everything the earlier tests' module-level caches hold (0.5 s
    a kernel; an int4 Llama's plan and compile took 18 s after `test_zoo.py`, 7 s in a fresh process).
    Frozen objects are still freed when their references go; only cycles among them wait for the
    process to end.
    """
    yield
    gc.collect()
    gc.freeze()


# The `slow` marker (registered in pyproject.toml). `pytest -m "not slow"` is the everyday
# loop; CI runs everything. A test function is listed here when one call takes more than
# about 3 s on 2 CPU cores (measured with `pytest --durations`; CONTRIBUTING.md has the
# figures): it starts processes, trains keras-hub backbones or compares a sharded `fit`
# with one device, or compiles several models. Every parametrization of a listed function
# is marked; "*" marks a whole module. Keeping the list here, not in the test files, says in
# one place what the fast loop leaves out; tests/test_docs.py checks that every name exists.
SLOW: dict[str, tuple[str, ...]] = {
    "test_headroom.py": ("test_a_resnet50_budget_plan_at_224_x_224_fits_once_compiled",),  # 20 s compile
    "test_dry.py": (  # a keras-hub task built, planned and compiled (15 s each)
        "test_a_task_that_compiles_itself_plans_dry_as_built",
        "test_compile_step_recompiles_a_task_with_the_optimizer_it_is_given",
    ),
    "test_budget.py": (  # compile a training step per case, against the planner's prediction
        "test_predicted_bytes_match_the_compiled_step",
        "test_predicted_bytes_match_on_other_backbones",
        "test_predicted_bytes_match_on_keras_attention_layers",
        "test_predicted_bytes_match_under_mixed_precision",
        "test_a_plan_under_a_tight_budget_trains_like_one_device",
        "test_a_large_final_layer_is_split_and_predicted",
        "test_predicted_bytes_match_on_custom_layer_grouped_query_attention",
        "test_fully_sharded_predicted_bytes_match_the_compiled_step",
        "test_a_fully_sharded_heads_input_gradient_is_predicted",
        "test_no_budget_keeps_todays_rules",
        "test_smaller_budgets_never_send_less",
        "test_a_biased_key_value_kernel_split_on_head_dim_is_predicted_and_trains",  # Qwen compiled, fit
    ),
    "test_peak.py": (  # compile a training step per case, against the predicted peak
        "test_predicted_peak_is_within_ten_percent_of_the_compiled_one",
        "test_a_plan_said_to_fit_its_budget_stays_under_it_once_compiled",
        "test_the_cli_peak_holds_the_gathered_key_value_kernels_as_auto_rules_does",  # two traced steps, 15 s
        "test_the_peak_of_a_fully_sharded_step_counts_its_gradients_whole_until_they_are_summed",
        "test_a_decoders_peak_over_a_longer_sequence_is_within_ten_percent_of_the_compiled_one",  # Gemma, 7 s
    ),
    "test_checkpoint.py": ("test_a_save_killed_by_sigkill_is_recovered_and_cleaned_up",),  # kills a process
    "test_checkpoint_faults.py": (  # real signals to real processes, a tmpfs; 1-3 fits with backups each
        "test_a_sigterm_in_the_last_validation_stops_the_run_as_after_any_step",  # two processes, 12 s
        "test_a_clean_stop_keeps_the_backup_at_its_step_and_resumes_exactly",
        "test_the_newest_backups_are_kept_with_their_steps",
        "test_the_guard_can_be_turned_off",
        "test_failed_saves_warn_until_too_many_fail_in_a_row",
        "test_sigterm_at_a_random_step_backs_up_that_step_and_the_restart_is_bit_exact",
        "test_a_second_job_on_a_held_directory_is_refused_until_the_holder_is_gone",
        "test_a_full_disk_during_a_background_save_is_one_line_and_training_goes_on",
        "test_a_nan_state_is_not_backed_up_and_the_restart_starts_from_the_last_finite_one",
        "test_a_failed_save_then_a_good_one_resets_the_count",
        "test_a_damaged_latest_backup_falls_back_to_the_one_before",
        "test_a_background_save_past_the_exit_deadline_is_named_and_left",
    ),
    "test_checkpoint_processes.py": (  # one launcher run of 2 processes × 4 devices; a save and 6 loads
        "test_a_load_without_rollback_frees_each_value_before_reading_its_replacement",
        "test_variables_are_split_across_the_processes",
        "test_each_process_wrote_its_own_shards",
        "test_restored_in_two_processes_on_the_other_layout",
        "test_restored_in_one_process_bit_for_bit",
    ),
    # five fully sharded MLP steps and two of a norm under a head compiled on 8 CPU devices (2-12 s each)
    "test_batch_gathers.py": ("*",),
    "test_qlora.py": (  # a keras-hub Gemma or an MLP planned and compiled per case (3-6 s each)
        "test_a_quantized_gemma_splits_its_heads_and_sends_what_is_compiled",
        "test_a_quantized_gemmas_smallest_plan_sends_what_is_compiled",
        "test_the_peak_of_a_quantized_gemma_is_within_ten_percent_of_the_compiled_one",
        "test_a_users_qlora_mlp_splits_its_frozen_pair_under_the_default_policy",
        "test_a_float_lora_model_under_the_default_policy_sends_what_is_compiled",
        "test_qlora_in_other_styles_and_families_sends_what_is_compiled",
    ),
    "test_adapters.py": ("*",),  # a LoRA and an int8 keras-hub Llama planned and compiled (one each)
    "test_cli.py": ("*",),  # every test runs the command line in a fresh process
    # a keras-hub Llama planned and compiled once (7 s), and trained sharded and on one device (4 s)
    "test_grouped_kv.py": ("*",),
    "test_cli_light.py": ("test_the_package_itself_imports_neither_until_a_name_is_used",),  # imports Keras
    # ConvNeXtTiny and Xception from keras.applications planned and compiled (12-13 s each)
    "test_conv_regions.py": (
        "test_keras_applications_depthwise_convnets_send_what_is_predicted",
        "test_on_xla_tpu_depthwise_convnets_send_what_their_regions_predict",  # for TPU v5e (20-35 s)
    ),
    "test_convs.py": (  # convnets compiled, trained against one device, or keras.applications built
        "test_the_planner_never_leaves_a_depthwise_conv_to_be_miscompiled",
        "test_fit_warns_when_it_starts_on_a_grouped_conv_of_the_users_own_layout",
        "test_predicted_bytes_match_the_compiled_step",
        "test_a_depthwise_convnet_trains_sharded_like_one_device",
        "test_convnets_near_the_tensor_parallel_ideal",
        "test_the_smallest_patch_embedding_plan_sends_what_its_units_predict",
        "test_a_patch_embedding_trains_sharded_like_one_device",
        "test_a_keras_hub_resnet_trains_like_one_device",
        "test_a_small_patch_conv_is_fully_sharded_in_the_smallest_plan_as_compiled",
        "test_a_small_first_conv_does_not_keep_the_next_pair_whole",
    ),
    "test_remat.py": ("test_a_rematerialised_step_sends_what_is_predicted",),  # a step compiled each (1-3 s)
    "test_docs.py": ("test_site_builds_with_no_warning",),  # runs `mkdocs build --strict`
    "test_targets.py": (  # XLA:TPU compiles (the toy steps' shared with the traffic test)
        "test_the_step_compiles_for_tpu_v5e_and_its_traffic_is_predicted",
        "test_the_peak_of_toy_steps_on_tpu_is_within_ten_percent_of_the_compiled_one",
        "test_the_peak_follows_xla_tpu_where_its_temporaries_are_in_hbm",
        "test_tensor_parallel_bytes_follow_xla_tpu_within_2_percent",  # one XLA:TPU compile each, 5-15 s
        "test_under_bfloat16_xla_tpu_moves_activations_in_bfloat16",
        "test_on_two_slices_the_batch_axis_sends_its_share_between_slices_as_predicted",  # 1-3 s each
        "test_fully_sharded_kernels_cross_slices_in_float32_as_predicted",  # 1-3 s each
        "test_v5p_and_v6e_send_what_the_planner_predicts",
        "test_fully_sharded_transformer_bytes_and_peak_follow_xla_tpu",  # a 2-layer Llama 3 compiled, each
        "test_a_windowed_reduce_scatter_is_counted_once_per_run_of_its_loop",  # an MLP at 16,384 rows
        "test_a_fully_sharded_moe_sends_what_xla_tpu_compiles_gathering_its_tokens",  # Mixtral, 6 s each
        "test_the_peak_of_a_fully_sharded_moe_follows_xla_tpu",  # the same compiles
        "test_expert_banks_on_an_expert_axis_send_what_xla_tpu_compiles",  # a Mixtral planned, compiled
        "test_a_fully_sharded_moe_on_a_model_axis_of_one_chip_splits_weights_over_the_expert_axis",
        "test_a_token_table_over_both_axes_is_looked_up_as_xla_tpu_compiles_it",  # v5e 4x4, 5 s
        "test_the_peak_of_an_expert_banks_swiglu_follows_xla_tpu",  # 16,384 tokens a chip, 7 s
        "test_a_windowed_kernel_gradient_reads_bfloat16_copies_of_its_inputs_as_the_walk_holds_them",
        "test_the_peak_of_a_convnet_on_tpu_counts_its_padded_activations_and_is_not_under_the_compiled_one",
        "test_the_peak_of_a_decoder_whose_temporaries_outgrow_the_chip_follows_xla_tpu",  # 2-layer Gemma
        "test_a_resnet_sends_what_xla_tpu_compiles",  # a toy ResNet and keras-hub's, 4-8 s each
    ),
    "test_mesh_choice.py": (
        "test_on_a_256_chip_v5e_the_choice_is_no_worse_than_brute_force",
        "test_a_moe_model_is_also_planned_on_expert_axes_and_the_choice_is_no_worse_than_brute_force",
        "test_each_split_over_the_batch_axis_also_has_a_fully_sharded_plan_sending_what_xla_compiles",
        "test_on_a_v5e_2x4_a_budget_no_tensor_parallel_plan_fits_is_met_by_splitting_over_the_batch_axis_too",
        "test_on_two_slices_the_batch_axis_is_costed_over_the_dcn_and_the_choice_agrees_with_brute_force",
    ),  # XLA:TPU compiles three 256-chip steps, plans nine splits over the target, each twice (7 s
    # loaded); a one-layer Mixtral planned on six 4-device splits and three fully sharded, by
    # choose_mesh and alone (4.9 s at load 2, 8.6 s with two layers); three fully sharded
    # steps compiled on 8 CPU devices (9 s); four on v5e 2x4 (6.5 s)
    "test_embeddings.py": (  # the tied table's plan and compile (one, shared), and its fit against one device
        "test_a_tied_table_is_vocab_parallel_without_a_budget",
        "test_a_tied_table_prediction_matches_the_compiled_step",
        "test_a_tied_table_trains_sharded_as_on_one_device",
        "test_a_position_table_looked_up_with_shared_ids_is_predicted_as_compiled",
        "test_the_smallest_plan_is_predicted_under_the_default_policy",
        # a shared table (two look-ups) planned and compiled: vocab-parallel, over both axes, and fit
        "test_a_shared_table_is_split_and_predicted",
        "test_a_shared_table_split_over_both_axes_is_predicted",
        "test_a_shared_table_over_both_axes_trains_sharded_as_on_one_device",
        "test_a_sliced_position_table_over_both_axes_trains_as_on_one_device",  # planned twice, and fit
    ),
    "test_experts.py": (  # keras-hub MoE backbones compiled, or trained against one device
        "test_expert_parallel_prediction_matches_the_compiled_step",
        "test_a_rebuilt_mixtral_trains_expert_parallel_like_one_device",
        "test_a_fully_sharded_moe_sends_what_xla_cpu_compiles_gathering_its_tokens",  # one compile, 4 s
        "test_a_dense_model_on_a_mesh_with_an_idle_expert_axis_is_predicted_as_compiled",  # one compile, 5 s
        "test_fully_sharded_on_a_model_axis_of_one_device_splits_weights_over_the_expert_axis",  # one compile
        "test_a_user_written_router_and_its_aux_loss_are_predicted_as_compiled",  # 3-10 s: one compile each
    ),
    "test_batch_sums.py": (  # one attention step with a relative-position bias compiled (5 s)
        "test_a_relative_bias_is_summed_in_the_heads_shards_and_its_table_gathered_after_the_update",
        "test_a_contrastive_head_sends_what_is_predicted",  # a two-tower step compiled (XLA:CPU, XLA:TPU)
    ),
    "test_zoo.py": (  # ~45 architectures planned (1-20 s each: dry builds, budget searches) and compiled
        "test_no_budget_parameters_per_device_near_the_tensor_parallel_ideal",
        "test_smallest_budget_plan_near_the_fully_sharded_floor",
        "test_predicted_bytes_per_axis_match_the_compiled_step",
        "test_the_auto_plan_matches_or_beats_keras_hubs_hand_map",
        "test_the_hand_maps_memory_as_the_budget_gives_a_plan_no_bigger_and_no_chattier",
        "test_rows_that_share_a_compile_are_planned_alike",
    ),
    "test_hub.py": (  # one keras-hub backbone per family trained against one device; a fresh interpreter
        "test_sharded_fit_matches_single_device",
        "test_preset_weights_load_sharded",
        "test_import_keras_hub_loads_no_tensorflow",
    ),
    "test_inference.py": (  # predict/evaluate/fit under the distribution against one device
        "test_predict_and_evaluate_any_sample_count_equal_one_device",
        "test_model_survives_an_exception",
        "test_on_batch_forms_and_validation_take_any_batch",
        "test_predict_a_generator_of_uneven_batches_on_an_uncompiled_model",
    ),
    "test_keras_compat.py": (  # Keras's own code, fit
        "test_keras_code_trains_the_same_with_our_classes",
        "test_fit_warns_once_about_a_rule_that_matched_nothing",
    ),
    "test_rules.py": (  # fits (against one device, before a checkpoint) and compiled steps
        "test_fit_with_a_kernel_split_over_both_axes_matches_one_device",
        "test_checkpoints_keep_multi_axis_layouts",
        "test_output_rules_are_matched_with_keras_meaning",
    ),
    "test_grouped_conv.py": (  # convnets planned, several each; Qwen 3.5's conv mixer trained and compiled
        "test_plan_warns_for_grouped_convolutions_on_a_2d_mesh",
        "test_no_warning_with_the_batch_alone_or_without_grouped_convolutions",
        "test_the_planned_depthwise_conv_trains_like_one_device",
        "test_the_depthwise_conv_sends_what_is_predicted",
    ),
    "test_policy.py": ("test_set_once_on_auto_rules_honoured_by_model_parallel",),  # planned and fit
    "test_comm.py": ("test_report_leaves_the_model_untouched",),  # a step compiled of its own
    "test_layout_map.py": ("test_converted_gemma_map_trains_like_one_device",),
    "test_multiprocess.py": (  # start processes (the launcher, a worker, a coordinator)
        "test_two_processes_train_like_one_process_of_eight_devices",
        "test_a_failing_worker_ends_the_job_naming_it",
        "test_second_job_on_a_running_jobs_port_fails_fast_and_the_first_finishes",
        "test_port_held_by_another_program_is_a_clear_error",
        "test_failing_process_stops_the_others_and_sets_the_exit_status",
        "test_launcher_timeout_stops_everything",
        "test_a_process_that_finished_while_another_waits_for_it_is_named",
        "test_process_that_never_joins_times_out_with_a_clear_message",
        "test_process_that_hangs_before_joining_is_named",
        "test_unreachable_coordinator_times_out_with_a_clear_message",
        "test_script_runs_unchanged_under_slurm",
        "test_raising_process_exits_at_once_without_the_launcher",
        "test_keras_loops_longer_than_xla_cpu_in_flight_limit",
    ),
    "test_names.py": ("test_backbone_splits_by_name_and_trains_like_one_device",),
    "test_planning.py": (  # end-to-end fits against one device
        "test_auto_rules_match_the_transformer_preset",
        "test_auto_rules_pair_an_mlp_stack_like_the_preset",
        "test_auto_plan_trains_like_one_device",
        "test_conv_preset_splits_output_channels_and_trains_like_one_device",
        "test_fsdp_axis_splits_weights_in_two_dimensions",
        "test_grouped_query_attention_replicates_key_value_heads",
        "test_heads_first_attention_is_split_on_its_heads_dimension",
    ),
    "test_progress.py": ("test_launcher_shows_the_join_only_where_someone_watches",),  # 2 processes, 6 s
    "test_public_api.py": (  # a fresh interpreter each
        "test_import_does_not_start_jax",
        "test_emulate_devices_after_jax_started",
        "test_other_keras_backend_is_a_clear_error",
    ),
    "test_recurrence.py": (  # a compile and a fit each, 5 s
        "test_the_split_recurrence_sends_what_the_compiled_step_sends_and_trains_like_one_device",
    ),
    "test_recipes.py": ("*",),  # every recipe and the demo, end to end in a fresh process
    "test_resume.py": ("*",),  # training interrupted and resumed, a killed process among them
    "test_styles.py": (  # every model style, fit
        "test_each_style_trains_sharded_like_one_device",
        "test_grouped_query_custom_layer_trains_like_one_device",
        "test_smallest_plan_trains_like_one_device",
    ),
    "test_training.py": (  # sharded fit against one device
        "test_layer_output_rules_apply_and_show_in_the_plan",
        "test_plain_keras_model_parallel_uses_first_match",
        "test_mlp_fit_matches_single_device",
        "test_attention_and_embedding_fit_with_heads_sharded",
        "test_batch_axis_need_not_be_first",
    ),
}

# Fixtures that start processes: every test using one is slow too (else the fast loop would
# still pay for the fixture).
SLOW_FIXTURES = ("two_process_run", "full_disk")


# The files that run longest, longest first: each file's seconds under `pytest -q -n 2
# --durations=0` (2026-12-07, sixteenth session, an idle machine, 16 min 37 s in all; CONTRIBUTING.md
# has the figures). Under `-n 2` each file runs whole in one process, and files are handed out in
# collection order to whichever process is free (`--no-loadscope-reorder` in pyproject.toml: xdist
# would otherwise hand out the files with the most tests first, and a file of a few long tests,
# started last, would run alone at the end). These start first, longest first (the greedy order
# that leaves the two processes' ends closest); the rest follow in their usual order and fill in.
# tests/test_docs.py checks that every name exists.
FIRST: tuple[str, ...] = (
    "test_targets.py",  # 215 s: XLA:TPU compiles
    "test_zoo.py",  # 202 s
    "test_conv_regions.py",  # 156 s: Xception and ConvNeXtTiny for XLA:TPU (62 s, 32 s)
    "test_resume.py",  # 121 s
    "test_budget.py",  # 92 s
    "test_recipes.py",  # 90 s; 9 tests, so xdist's default started it last
    "test_multiprocess.py",  # 83 s
    "test_convs.py",  # 76 s
    "test_checkpoint_faults.py",  # 68 s
    "test_adapters.py",  # 62 s
    "test_hub.py",  # 57 s
    "test_peak.py",  # 57 s
    "test_cli.py",  # 44 s
    "test_styles.py",  # 40 s
    "test_names.py",  # 36 s
    "test_experts.py",  # 34 s
    "test_qlora.py",  # 33 s
    "test_inference.py",  # 33 s
    "test_checkpoint.py",  # 26 s
    "test_compiled_plan.py",  # 26 s
    "test_headroom.py",  # 22 s
    "test_planning.py",  # 21 s
    "test_embeddings.py",  # 18 s
    "test_checkpoint_processes.py",  # 16 s
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs the `FIRST` files first; marks the tests `SLOW` and `SLOW_FIXTURES` name as `slow`."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: in-file order kept
    for item in items:
        names = SLOW.get(item.path.name, ())
        uses = set(getattr(item, "fixturenames", ()))
        if "*" in names or getattr(item, "originalname", item.name) in names or uses & set(SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)
