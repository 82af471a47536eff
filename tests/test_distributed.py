"""Injected models under torch.distributed: the order rule (inject_, then DDP / fully_shard; a sharded model is
refused), parameter identity, DDP over 2 CPU processes (gloo), FSDP2 with world size 1 (gloo on the CPU: FSDP2 runs
there in torch 2.14; nccl on the GPU), and benchmarks/distributed.py's smoke run.

Each training run is compared with the same model without dropin trained in float64 without any wrapper: the
losses, and the parameters' change over the steps (plain SGD: the learning rate times the sum of the gradients).
Under the interpreter a tiny Llama's training step takes seconds: two steps per run. TF32 is off (true_fp32).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dropin
from dropin.bench.models import gradient_errors
from _tol import DEVICE, ON_GPU, TOLERANCES, assert_close, gpu, rel_err, slow, tolerance

pytest.importorskip("transformers")
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_module, init_device_mesh  # noqa: E402

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "distributed.py"
_spec = importlib.util.spec_from_file_location("distributed_benchmark", BENCHMARK)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

STEPS, LR = 2, 0.5


@pytest.fixture(autouse=True)
def _true_fp32(true_fp32):
    yield


@pytest.fixture
def world_of_one():
    """A process group of this process alone (gloo on the CPU, nccl on the GPU), destroyed after the test."""
    dist.init_process_group("nccl" if ON_GPU else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def llama() -> nn.Module:
    """The benchmark's tiny Llama (LlamaForCausalLM, hidden 64), seeded: the same weights on each call."""
    return bench.build("llama", True, torch.device(DEVICE))


def token_batches(steps: int = STEPS, rank: int = 0) -> list:
    return bench.batches("llama", True, steps, torch.float32, torch.device(DEVICE), rank)


def lm_loss(model, batch):
    return model(**batch).loss


def sgd(model: nn.Module, batches: list, loss_fn=lm_loss, probe=None) -> tuple:
    """Plain SGD, a step per batch: (the losses, {parameter: its change}, with `probe` the output of a no-grad
    forward on it after each step), full tensors (FSDP2's gathered). The optimizer is made first: FSDP2's root keeps
    its parameters unsharded after a no-grad forward, and `parameters()` then gives those, not the sharded ones."""
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p  # noqa: E731
    before = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, outputs = [], []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if probe is not None:
            with torch.no_grad():
                outputs.append(model(probe))
    deltas = {n.removeprefix("module."): full(p).detach() - before[n] for n, p in model.named_parameters()}
    return (torch.stack(losses), deltas) + ((torch.stack(outputs),) if probe is not None else ())


def assert_same_training(got: tuple, ref: tuple, dtype: torch.dtype) -> None:
    """Losses and parameter changes (sgd's) of a run against the float64 reference run's; a change's error is
    relative to at least a small share of the largest change (bench.models.gradient_errors: a norm's weight
    gradient sums terms that cancel, torch's own float32 error there reaches 5e-5 in two steps)."""
    loss_error = rel_err(got[0], ref[0])  # (a bf16 model's loss may be float32: HF upcasts the logits)
    assert loss_error <= tolerance(dtype, "bwd"), f"losses: relative error {loss_error:.2e}"
    errors = gradient_errors(got[1], ref[1])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance(dtype, "bwd"), f"change of {worst}: relative error {errors[worst]:.2e}"


def float64_training(make, batches: list, loss_fn=lm_loss) -> tuple:
    """The reference: the model without dropin, in float64, without any wrapper."""
    to64 = lambda b: {k: v.double() if v.is_floating_point() else v for k, v in b.items()}  # noqa: E731
    return sgd(make().double(), [to64(b) for b in batches], loss_fn)


def test_inject_keeps_parameter_identity():
    """DDP's buckets and FSDP2's sharding see the parameters of the model as built: inject_ swaps modules, never
    parameters (torchvision ResNet: folded convs and fused blocks; HF Llama: fused MLP, norms, attention)."""
    torchvision = pytest.importorskip("torchvision")
    for model in (torchvision.models.resnet18().eval(), llama()):
        before = [(n, id(p)) for n, p in model.named_parameters()]
        report = dropin.inject_(model, verify=False)
        assert report.replaced
        assert [(n, id(p)) for n, p in model.named_parameters()] == before


def test_inject_refuses_a_sharded_model(world_of_one):
    """FSDP2's modules (their parameters DTensors, or unsharded and kept so after a forward) and DTensor parameters
    (a tensor-parallel layout) are refused, the message naming the order to use; the model is left as it was."""
    model = llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with pytest.raises(dropin.inject.InjectError, match=r"already sharded \(module '<root>' is a "
                       r"FSDPLlamaForCausalLM\): call dropin.inject_\(model\) first, then fully_shard"):
        dropin.inject_(model, verify=False)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(DEVICE)
    fully_shard(model, reshard_after_forward=False)
    model(torch.randn(2, 4, device=DEVICE))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    with pytest.raises(dropin.inject.InjectError, match=r"module '<root>' is a FSDPSequential"):
        dropin.inject_(model, verify=False)
    assert isinstance(model[1], nn.ReLU)
    model = distribute_module(nn.Sequential(nn.Linear(4, 4)).to(DEVICE), init_device_mesh(DEVICE, (1,)))
    with pytest.raises(dropin.inject.InjectError, match=r"parameter '0.weight' is a DTensor"):
        dropin.inject_(model, verify=False)
    assert type(model[0]) is nn.Linear


def test_inject_through_a_ddp_wrapper(world_of_one):
    """inject_ on a DistributedDataParallel injects its `.module`, keeping the parameters that DDP's reducer holds,
    and the wrapped model computes as the model injected first."""
    model = llama()
    ddp = nn.parallel.DistributedDataParallel(model)
    params = [id(p) for p in ddp.parameters()]
    report = dropin.inject_(ddp, verify=False)
    assert report.replaced and not any(r.name.startswith("module") for r in report.replaced)  # paths in .module
    assert isinstance(ddp.module.model.layers[0].mlp, dropin.nn.DropinModule)
    assert [id(p) for p in ddp.parameters()] == params
    injected_first = llama()
    dropin.inject_(injected_first, verify=False)
    batch = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(ddp(**batch).logits, injected_first(**batch).logits, rtol=0, atol=0)
    dropin.revert_(ddp)
    assert not any(isinstance(m, dropin.nn.DropinModule) for m in ddp.modules())


def _ddp_worker(rank: int, world: int, folder: str) -> None:
    """One rank of test_ddp_two_processes, writing folder/rank<rank>.pt: the injected tiny Llama under DDP, and
    (rank 0) the float64 reference trained in one process on both ranks' batches."""
    out, store = os.path.join(folder, f"rank{rank}.pt"), os.path.join(folder, "store")
    torch.set_num_threads(1)  # a core each
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        batches = token_batches(rank=rank)
        model = llama()
        dropin.inject_(model, verify=False)
        losses, deltas = sgd(nn.parallel.DistributedDataParallel(model), batches)
        dist.all_reduce(losses)  # the mean over ranks: the loss of the whole batch (equal token counts)
        gathered = [[torch.empty_like(b["input_ids"]) for _ in range(world)] for b in batches]
        for ids, b in zip(gathered, batches):
            dist.all_gather(ids, b["input_ids"])
        if rank == 0:
            whole = [{"input_ids": torch.cat(ids), "labels": torch.cat(ids)} for ids in gathered]
            torch.save({"injected": (losses / world, deltas), "reference": float64_training(llama, whole)}, out)
        else:
            torch.save({"injected": (losses / world, deltas)}, out)
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes(tmp_path, monkeypatch):
    """DDP (gloo, 2 CPU processes, each its own half of the batch) of the injected model, inject_ first: its losses
    and parameter changes match one float64 process training the model without dropin on the whole batch (DDP's
    gradient average), and both ranks end with the same parameters."""
    import torch.multiprocessing as mp

    # The children inherit the environment: conftest's TRITON_INTERPRET=1 before they import triton, and a thread
    # per BLAS (numpy's under the interpreter) so that the two share the cores without contention.
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert_same_training(ranks[0]["injected"], ranks[0]["reference"], torch.float32)
    for name, delta in ranks[1]["injected"][1].items():
        assert torch.equal(delta, ranks[0]["injected"][1][name]), name


def test_fsdp2_trains_an_injected_llama(world_of_one):
    """FSDP2 (each decoder layer, then the root), inject_ first: the drop-ins read the parameters FSDP2 unshards for
    each step (the norms too: they share the norm's parameter dict)."""
    batches = token_batches()
    model = llama()
    dropin.inject_(model, verify=False)
    got = sgd(bench.wrap(model, "fsdp2", torch.float32, torch.device(DEVICE)), batches)
    assert_same_training(got, float64_training(llama, batches), torch.float32)


@gpu
def test_fsdp2_mixed_precision_gpu(world_of_one):
    """FSDP2 with bf16 parameters and float32 gradient reduction (MixedPrecisionPolicy), on one GPU (nccl)."""
    batches = token_batches()
    model = llama()
    dropin.inject_(model, verify=False)
    got = sgd(bench.wrap(model, "fsdp2", torch.bfloat16, torch.device(DEVICE)), batches)
    assert_same_training(got, float64_training(llama, batches), torch.bfloat16)


def image_batches(steps: int) -> list:
    generator = torch.Generator(DEVICE).manual_seed(1)
    return [{"x": torch.randn(2, 3, 4, 4, generator=generator, device=DEVICE)} for _ in range(steps)]


def square_loss(model, batch):
    return model(batch["x"]).square().mean()


def sharded_training(make, train: bool) -> tuple:
    """4 SGD steps of make()'s model injected under FSDP2 and of its float64 reference without dropin, each step
    followed by a no-grad forward on one more batch: their `sgd` results. (From about the third step on, FSDP2
    all-gathers a step's parameters into the memory of an earlier step's.)"""
    *batches, probe = image_batches(5)
    model = make().to(DEVICE).train(train)
    dropin.inject_(model, verify=False)
    got = sgd(fully_shard(model), batches, square_loss, probe["x"])
    reference = make().to(DEVICE).double().train(train)
    return got, sgd(reference, [{"x": b["x"].double()} for b in batches], square_loss, probe["x"].double())


def assert_same_probed_training(got: tuple, ref: tuple) -> None:
    assert_same_training(got[:2], ref[:2], torch.float32)
    for step, (out, out_ref) in enumerate(zip(got[2], ref[2])):
        assert_close(out, out_ref, torch.float32, "fwd", what=f"no-grad output after step {step + 1}")


def conv_bn() -> nn.Module:
    torch.manual_seed(0)
    # (one parameter in the fold: FSDP2's all-gather then puts it in the memory of an earlier step's at once)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, affine=False), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def test_fsdp2_conv_bn_folded_reads_the_updated_weights(world_of_one):
    """An eval-mode BatchNorm folded into its conv (ConvBNAct), the conv trained under FSDP2: each no-grad forward
    folds the weights FSDP2 unshards then, not a fold kept from an earlier forward (FSDP2's all-gather keeps the
    unsharded parameter's identity and version counter, so a changed weight does not show)."""
    assert_same_probed_training(*sharded_training(conv_bn, train=False))


def test_fsdp2_load_state_dict_refreshes_an_injected_model(world_of_one):
    """load_state_dict on the sharded injected model (its parameters DTensors) refreshes the drop-ins without folding
    the shards; the next forward folds the loaded weights."""
    model = conv_bn().to(DEVICE).eval()
    dropin.inject_(model, verify=False)
    sharded = fully_shard(model)
    sharded.load_state_dict({k: v * 2 if isinstance(v, DTensor) else v for k, v in sharded.state_dict().items()})
    reference = conv_bn().to(DEVICE).double().eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(2)
        x = image_batches(1)[0]["x"]
        assert_close(sharded(x), reference(x.double()), torch.float32, "fwd")


def convs() -> nn.Module:
    torch.manual_seed(0)
    # (no bias before the training-mode BatchNorm: its gradient is 0 in exact arithmetic, rounding noise in float32)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def test_fsdp2_convs_read_the_updated_weights(world_of_one):
    """A dense and a depthwise conv trained under FSDP2 (training-mode BatchNorm): FSDP2 gathers each step's weights
    into the same memory without bumping their version, so a weight copy kept across steps would go stale."""
    assert_same_probed_training(*sharded_training(convs, train=True))


def run_benchmark(tmp_path, *args) -> list:
    """benchmarks/distributed.py run with `args` in a new process; its JSON rows."""
    out = tmp_path / "distributed.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["env"]["world_size"] == 1 and result["env"]["torch"] == torch.__version__
    return result["rows"]


def assert_benchmark_rows(rows: list, models: tuple, max_loss_diff: float) -> None:
    assert [(r["model"], r["mode"], r["provider"]) for r in rows] == [
        (m, mode, p) for m in models for mode in ("ddp", "fsdp2") for p in ("original", "dropin")]
    for original, injected in zip(rows[::2], rows[1::2]):
        assert "error" not in original and "error" not in injected, (original, injected)
        assert "verified: output within tolerance" in injected["inject"]
        assert len(injected["losses"]) == len(original["losses"]) and injected["max_loss_rel_diff"] <= max_loss_diff
        assert injected["throughput"] > 0 and original["throughput"] > 0


def test_benchmark_merges_runs_into_one_file(tmp_path):
    """A run's rows replace those of its (model, mode) pairs in an existing file of the same GPU and world size and
    keep the others (one invocation per model); a file of another world size is replaced."""
    out = tmp_path / "distributed.json"
    env = {"gpu": "NVIDIA H100", "world_size": 2}
    row = lambda model, mode, provider, loss: {"model": model, "mode": mode, "provider": provider,  # noqa: E731
                                               "losses": [loss]}
    out.write_text(json.dumps({"env": env, "rows": [row("llama", "ddp", p, 1.0) for p in ("original", "dropin")] +
                                                   [row("llama", "fsdp2", p, 1.0) for p in ("original", "dropin")]}))
    new = [row("llama", "fsdp2", p, 2.0) for p in ("original", "dropin")]
    assert bench.merged(out, dict(env), new)["rows"] == json.loads(out.read_text())["rows"][:2] + new
    assert bench.merged(out, dict(env, world_size=1), new)["rows"] == new


@pytest.mark.skipif(ON_GPU, reason="the GPU runs test_benchmark_smoke_gpu")
def test_benchmark_smoke_cpu(tmp_path):
    """The script end to end on the CPU (gloo, tiny Llama, interpreter, one step: seconds each): rows for both modes
    and providers, the injected model verified by inject_ and its loss within float32 noise of the original's."""
    rows = run_benchmark(tmp_path, "--device", "cpu", "--tiny", "--model", "llama", "--steps", "1")
    assert_benchmark_rows(rows, ("llama",), TOLERANCES[torch.float32][1])


@gpu
@slow  # (147 s on an H100, the longest of test-gpu; the GPU's DDP and FSDP2 paths are test_ddp_* and test_fsdp2_*'s)
def test_benchmark_smoke_gpu(tmp_path):
    """Both models, both modes, bf16, world size 1 on the GPU (nccl), tiny configs; peak memory per rank."""
    rows = run_benchmark(tmp_path, "--tiny", "--steps", "4")
    assert_benchmark_rows(rows, ("cvt-13", "llama"), TOLERANCES[torch.bfloat16][0])
    assert all(len(r["peak_memory_mib"]) == 1 and r["peak_memory_mib"][0] > 0 for r in rows)
