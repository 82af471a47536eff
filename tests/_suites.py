"""The tests `make test-gpu-quick` runs (conftest marks them `quick`), and the longest tests of the slow suite and of
`make test-gpu`."""

# Each public op forward and backward, each injector handler and each execution mode once.
QUICK = (
    "tests/ops/test_matmul.py::test_matmul_2d[tall-1000x7x33-bf16]",
    "tests/ops/test_matmul.py::test_bmm[4x33x7x17-bf16]",
    "tests/ops/test_matmul.py::test_linear_activation[relu-bias-bf16]",
    "tests/ops/test_matmul.py::test_float32_follows_allow_tf32[linear-allow_tf32-off]",
    "tests/ops/test_conv2d.py::test_seed000[k3-s1-p1-bf16]",
    "tests/ops/test_conv2d_kernels.py::test_depthwise_direct[m1-s1-nchw-bf16]",
    "tests/ops/test_conv2d.py::test_residual[dense-channels_last]",
    "tests/ops/test_conv2d.py::test_fold_batchnorm[True-True]",
    "tests/ops/test_attention.py::test_lengths[70x64-d64-causal-bf16]",
    "tests/ops/test_attention.py::test_masks[BxHxLqxLk-float-bf16]",
    "tests/ops/test_attention.py::test_grouped_query[causal-gqa-6-2-bf16]",
    "tests/ops/test_rms_norm.py::test_rms_norm[residual-33x7-bf16]",
    "tests/ops/test_rope.py::test_rope[cos-2d-2x4x4x7x16-bf16]",
    "tests/ops/test_swiglu.py::test_swiglu_mlp[7x33-i50-bf16]",
    "tests/ops/test_pooling.py::test_max_pool_resnet[bf16-channels_last]",
    "tests/ops/test_pooling.py::test_avg_pool_dtypes_layouts[bf16-nchw]",
    "tests/ops/test_pooling.py::test_adaptive_avg_pool_sizes[channels_last-output_size2]",
    "tests/ops/test_layer_norm.py::test_row_lengths[bf16-33]",
    "tests/ops/test_group_norm.py::test_shapes[bf16-between-2x6x5x7-g3]",
    "tests/ops/test_batch_norm.py::test_4d[train-bf16-channels_last]",
    "tests/ops/test_batch_norm.py::test_4d[eval-bf16-nchw]",
    "tests/ops/test_softmax.py::test_row_lengths[bf16-33-softmax]",
    "tests/ops/test_softmax.py::test_row_lengths[bf16-33-log_softmax]",
    "tests/ops/test_activation_ops.py::test_dtypes[bf16-relu]",
    "tests/ops/test_activation_ops.py::test_dtypes[bf16-gelu]",
    "tests/ops/test_activation_ops.py::test_dtypes[bf16-silu]",
    "tests/ops/test_sparse.py::test_sparse_linear[1x1000->7-90%-bf16]",
    "tests/ops/test_sparse_conv2d.py::test_sparse_conv2d[3x3-p1-bf16]",
    # execution modes: eager is every test above; torch.compile, a CUDA graph, reduce-overhead
    "tests/ops/test_attention.py::test_torch_compile_fullgraph[bf16]",
    "tests/inject/test_generic.py::test_torch_compile_fullgraph[cnn-shape1]",
    "tests/test_modes.py::test_op_cuda_graph[conv2d+residual+relu]",
    "tests/test_modes.py::test_op_reduce_overhead[rms_norm+residual]",
    "tests/test_modes.py::test_model_cuda_graph[resnet18]",
    "tests/test_modes.py::test_model_reduce_overhead[llama]",
    # injector handlers
    "tests/inject/test_generic.py::test_cnn_eval_conv_bn_relu_fused",
    "tests/inject/test_generic.py::test_mlp_linear_activation_fused",
    "tests/inject/test_torchvision.py::test_blocks_fused_in_eval",
    "tests/inject/test_llama.py::test_llama_injected_verified_and_hf_forward_unchanged",
    "tests/inject/test_llama.py::test_llama_training_backward_matches_torch",
    "tests/inject/test_hf_families.py::test_decoder_family_injected_verified[gemma]",
    "tests/inject/test_hf_families.py::test_gpt2_conv1d_and_gelu_fused_verified",
    "tests/inject/test_cvt.py::test_cvt_fused_verified_and_hf_forward_unchanged",
    "tests/inject/test_groupnorm_conv1d.py::test_conv1d_groupnorm_model_injected_verified_and_reverted",
    "tests/inject/test_sparse_inject.py::test_only_the_sparse_layers_go_sparse[dtype1]",
    # the route for functional code (dropin.use()): eager, and compiled
    "tests/test_route.py::test_functional_model_routed[attention]",
    "tests/test_route.py::test_compile_routed_block_cuda[default]",
)


# The slow GPU tests that take longest, slowest first (seconds on an H200 beside another suite on the other GPU,
# 2026-11-27: 309, 147 on an H100, 93, 79, 70, 56-67). In the slow suite (`-m slow`) conftest puts them first, and
# `make test-gpu-slow` hands items out in that order (xdist's load scheduling): the part's wall time is then about
# its longest test's, where in file order test_benchmark_smoke_gpu started last and ran past the part's 390 s.
SLOWEST_FIRST = (
    "tests/test_cli_inject.py::test_inject_hf_models_full_size",
    "tests/test_distributed.py::test_benchmark_smoke_gpu",
    "tests/test_cli_inject.py::test_inject_train_step_within_limits",
    "tests/ops/test_conv2d.py::test_random_configs",
    "tests/ops/test_conv2d_kernels.py::test_every_config",
    "tests/test_modes.py::test_model_reduce_overhead",
)


# test-gpu's tests that take longest, slowest first (seconds on an H200 beside the fuzz suite on the other GPU,
# 2026-11-28 18:56: 108, 99, 91, 85, 64, 58, 57, 56, 53, 49, 48 and 38-48). Its 3,150 tests took 8,045 s in all,
# 503 s on 16 workers evenly shared; in file order these start late and run past the others' ends. conftest puts
# them first and `make test-gpu` hands items out in order (the Makefile's IN_ORDER).
TEST_GPU_LONGEST_FIRST = (
    "tests/bench/test_classes.py::test_every_class_runs_checked_and_summarized",
    "tests/test_cli_inject.py::test_inject_bench_writes_rows",
    "tests/inject/test_torchvision.py::test_maxvit_attention",
    "tests/bench/test_zoo.py::test_tiny_run_rows_resume_and_failures",
    "tests/test_cli_inject.py::test_rows_after_a_device_error_run_in_a_fresh_process",
    "tests/test_kernel_writes.py::test_kernels_write_only_their_outputs",
    "tests/test_cli_inject.py::test_inject_hf_models_full_size",
    "tests/test_cli_inject.py::test_inject_generate_rows",
    "tests/test_cli_inject.py::test_inject_bench_every_mode_runs",
    "tests/test_cli_inject.py::test_inject_train_curve_writes_the_losses",
    "tests/test_cli_inject.py::test_inject_bench_llama_has_no_plain_graph_rows",
    "tests/bench/test_zoo.py::test_torchvision_inputs_fit_each_model",
    "tests/bench/test_attention_suite.py::test_quick_cases_pass",
    "tests/test_modes.py::test_model_reduce_overhead",
    "tests/inject/test_hf_families.py::test_hf_convnext_layer_as_one_block",
    "tests/inject/test_timm.py::test_timm_convnext_block",
    "tests/inject/test_cvt.py::test_cvt_training_backward_matches_torch",
    "tests/test_cli_inject.py::test_failed_curve_still_writes_the_rows",
    "tests/inject/test_torchvision.py::test_training_mode_blocks_not_fused_and_backward_matches_torch",
    "tests/test_cli_inject.py::test_inject_hf_models_verified",
    "tests/test_cli.py::test_bench_layer_suites_quick",
    "tests/test_suites.py::test_slowest_first_names_slow_tests",
    "tests/test_distributed.py::test_ddp_two_processes",
    "tests/inject/test_torchvision.py::test_swin_window_attention",
    "tests/test_modes.py::test_model_cuda_graph",
    "tests/inject/test_torchvision.py::test_torchvision_resnet",
)
