"""Test set-up shared by the whole suite.

- Without a CUDA device the Triton interpreter is switched on (TRITON_INTERPRET=1) here, before dropin or
  triton is imported, so every kernel runs on CPU tensors.
- Kernel configs are not tuned: the first candidate runs (DROPIN_AUTOTUNE=0 unless set).
- Tests marked `gpu` are skipped without a CUDA device (or when the interpreter was forced on).
- Each test seeds torch with a fresh random seed, shown in the report when the test fails;
  DROPIN_TEST_SEED=<seed> replays it.
- DROPIN_TEST_TIMES=<file>: each finished test appends one line (outcome, seconds, worker, test id) to that file
  as it ends, so a run cut off by a time limit still shows where its time went.
"""
import json
import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Tests never tune (each config is checked by test_matmul_configs); DROPIN_AUTOTUNE=1 overrides.
os.environ.setdefault("DROPIN_AUTOTUNE", "0")

# pytest-xdist workers share the CPU cores for the float64 references: one process's thread pool over all of
# them, in every worker at once, oversubscribes the machine many times.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import _tol` from any test folder

import _tol  # noqa: E402  (reads TRITON_INTERPRET, set above)


def pytest_report_header(config):
    import triton

    where = torch.cuda.get_device_name() if _tol.ON_GPU else "cpu, Triton interpreter"
    return f"dropin tests: device={_tol.DEVICE} ({where}), torch {torch.__version__}, triton {triton.__version__}"


# `make test-gpu-quick`: each public op forward and backward, each injector handler and each execution mode once.
QUICK = (
    "tests/ops/test_matmul.py::test_matmul_2d[tall-1000x7x33-bf16]",
    "tests/ops/test_matmul.py::test_bmm[4x33x7x17-bf16]",
    "tests/ops/test_matmul.py::test_linear_activation[relu-bias-bf16]",
    "tests/ops/test_matmul.py::test_float32_follows_allow_tf32[linear-allow_tf32-off]",
    "tests/ops/test_conv2d.py::test_seed000[k3-s1-p1-bf16]",
    "tests/ops/test_conv2d.py::test_depthwise_direct[m1-s1-nchw-bf16]",
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
    "tests/ops/test_batch_norm.py::test_4d[train-bf16-channels_last]",
    "tests/ops/test_batch_norm.py::test_4d[eval-bf16-nchw]",
    "tests/ops/test_softmax.py::test_row_lengths[bf16-33-softmax]",
    "tests/ops/test_softmax.py::test_row_lengths[bf16-33-log_softmax]",
    "tests/ops/test_activation_ops.py::test_dtypes[bf16-relu]",
    "tests/ops/test_activation_ops.py::test_dtypes[bf16-gelu]",
    "tests/ops/test_activation_ops.py::test_dtypes[bf16-silu]",
    "tests/ops/test_sparse.py::test_sparse_linear[1x1000->7-90%-bf16]",
    "tests/ops/test_sparse_conv2d.py::test_sparse_conv2d[3x3-p1-bf16]",
    # execution modes: eager is every test above; torch.compile and a CUDA graph
    "tests/ops/test_attention.py::test_torch_compile_fullgraph[bf16]",
    "tests/inject/test_generic.py::test_torch_compile_fullgraph[cnn-shape1]",
    "tests/inject/test_llama.py::test_llama_cuda_graph",
    # injector handlers
    "tests/inject/test_generic.py::test_cnn_eval_conv_bn_relu_fused",
    "tests/inject/test_generic.py::test_mlp_linear_activation_fused",
    "tests/inject/test_torchvision.py::test_blocks_fused_in_eval",
    "tests/inject/test_llama.py::test_llama_injected_verified_and_hf_forward_unchanged",
    "tests/inject/test_llama.py::test_llama_training_backward_matches_torch",
    "tests/inject/test_cvt.py::test_cvt_fused_verified_and_hf_forward_unchanged",
    "tests/inject/test_sparse_inject.py::test_only_the_sparse_layers_go_sparse[dtype1]",
)


def pytest_collection_modifyitems(config, items):
    quick = set(QUICK)
    for item in items:
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
            quick.discard(item.nodeid)
    if quick and "quick" in (config.option.markexpr or ""):
        raise pytest.UsageError(f"conftest.QUICK names tests that were not collected: {sorted(quick)}")
    if _tol.ON_GPU:
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (this run uses the Triton interpreter on the CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("DROPIN_TEST_TIMES")
    # under xdist the controller sees every report again (with the worker's node): the workers write them
    if path and (report.when == "call" or report.outcome != "passed") and not hasattr(report, "node"):
        line = {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
                "s": round(report.duration, 3), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    seed = int(os.environ.get("DROPIN_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    request.node.add_report_section("setup", "seed", f"DROPIN_TEST_SEED={seed}")
    yield
    if _tol.ON_GPU:  # parallel workers share the GPU: none keeps a test's cached blocks for the next
        torch.cuda.empty_cache()


@pytest.fixture
def true_fp32():
    """TF32 off for one test, for convolutions (cuDNN's default is on) and matmuls; both switches restored."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def allow_tf32():
    """Sets torch.backends.cuda.matmul.allow_tf32 for one test (call it with True/False); restores it after."""
    saved = torch.backends.cuda.matmul.allow_tf32

    def set_(value: bool):
        torch.backends.cuda.matmul.allow_tf32 = value

    yield set_
    torch.backends.cuda.matmul.allow_tf32 = saved
