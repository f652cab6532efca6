"""GPU, two or more cards (issue 31): kernels on a GPU other than the current one, on two GPUs in one process, and in
two processes (one per GPU, as DDP runs) that meet one new problem; then bench.model_ddp on one GPU and on two.

Each test runs in fresh interpreters with fresh KERNELS_CACHE_DIRs, aten and Triton only (a fresh cache would start
the CUTLASS set's background build on every core), and NVLink multicast off in every process it starts (NCCL_NVLS_ENABLE
=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1: bench/ddp_world.py says why)."""
import json
import textwrap
import time

import pytest
import torch

from bench.ddp_world import MULTICAST_OFF
from tests.helpers import run_module, run_python, start_python

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _env(cache, **more) -> dict:
    return {**MULTICAST_OFF, "KERNELS_CACHE_DIR": str(cache), "KERNELS_BACKENDS": "aten,triton",
            "TRITON_INTERPRET": None, "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, **more}


def _last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- a: a problem tuned on cuda:1 while cuda:0 is current ------------------------------------------------------------
ON_DEVICE = textwrap.dedent("""
    import json, os, torch, kernels
    index = int(os.environ["TEST_DEVICE"])
    other = 1 - index
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    a = torch.randn(1000, 768, device=f"cuda:{index}", dtype=torch.bfloat16)
    b = torch.randn(768, 1024, device=f"cuda:{index}", dtype=torch.bfloat16)
    torch.cuda.synchronize(index)
    before_other = torch.cuda.memory_allocated(other)
    torch.cuda.reset_peak_memory_stats(other)
    c = kernels.mm(a, b)
    torch.cuda.synchronize(index)
    ref = a.double() @ b.double()
    sel = kernels.explain(a, b)
    print(json.dumps({"out": str(c.device), "current": torch.cuda.current_device(),
                      "err": float((c.double() - ref).norm() / ref.norm()),
                      "other_before": before_other, "other_peak": torch.cuda.max_memory_allocated(other),
                      "candidates": sorted(sel.timings), "failed": sorted(sel.failures()), "winner": sel.winner,
                      "winner_ms": sel.timings[sel.winner], "stats": kernels.stats()}))
""")


def test_a_problem_on_the_second_gpu_is_tuned_there_as_on_the_first(tmp_path):
    """1000x1024x768 bf16 on cuda:1 with cuda:0 current, then in a second process with a fresh cache on cuda:0 (one
    process would find the first tune on disk): the same candidates, winners as fast within 15%, and nothing of the
    tune ever allocated on the current, other, GPU."""
    on_1 = _last_json(run_python(ON_DEVICE, _env(tmp_path / "c1", TEST_DEVICE="1")))
    on_0 = _last_json(run_python(ON_DEVICE, _env(tmp_path / "c0", TEST_DEVICE="0")))
    assert on_1["out"] == "cuda:1" and on_0["out"] == "cuda:0"
    assert on_1["current"] == 0 and on_0["current"] == 0
    assert on_1["err"] < 1e-2 and on_0["err"] < 1e-2
    assert on_1["stats"]["tunes"] == on_0["stats"]["tunes"] == 1
    assert on_1["other_peak"] == on_1["other_before"] == 0          # cuda:0 current, yet untouched by cuda:1's tune
    assert on_1["candidates"] == on_0["candidates"] and len(on_1["candidates"]) > 1
    assert on_1["failed"] == on_0["failed"]
    assert abs(on_1["winner_ms"] - on_0["winner_ms"]) <= 0.15 * on_0["winner_ms"], (on_1["winner"], on_0["winner"])


# -- b: two GPUs in one process, interleaved ------------------------------------------------------------------------
INTERLEAVED = textwrap.dedent("""
    import json, os, torch, kernels
    torch.cuda.set_device(0)
    fastpath = kernels.load_fastpath() if os.environ["KERNELS_FASTPATH"] == "build" else kernels.fastpath_status()
    torch.manual_seed(0)
    shapes = {"p": (512, 384, 640), "q": (96, 1024, 256)}          # (M, K, N)
    operands = {(name, d): (torch.randn(m, k, device=f"cuda:{d}", dtype=torch.bfloat16),
                            torch.randn(k, n, device=f"cuda:{d}", dtype=torch.bfloat16))
                for name, (m, k, n) in shapes.items() for d in (0, 1)}
    calls = []
    # p meets cuda:0 first, q cuda:1: each is tuned on one GPU and loaded on the other, then served warm on both
    for name, d in [("p", 0), ("p", 1), ("q", 1), ("q", 0)] * 3:
        other, (a, b) = 1 - d, operands[name, d]
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        before = torch.cuda.memory_allocated(other)
        torch.cuda.reset_peak_memory_stats(other)
        c = kernels.mm(a, b)
        torch.cuda.synchronize(d)
        ref = a.double() @ b.double()
        calls.append({"call": f"{name}@cuda:{d}", "out": str(c.device), "current": torch.cuda.current_device(),
                      "err": float((c.double() - ref).norm() / ref.norm()), "other_before": before,
                      "other_after": torch.cuda.memory_allocated(other),
                      "other_peak": torch.cuda.max_memory_allocated(other)})
        del c, ref
    print(json.dumps({"calls": calls, "stats": kernels.stats(), "fastpath": fastpath}))
""")


@pytest.mark.parametrize("fastpath", ["off", "build"])
def test_two_gpus_in_one_process_each_call_stays_on_its_own(tmp_path, fastpath):
    """Triton only (its launchers hold per-device state); with the C++ warm-call table too (`build`), which keys
    calls by device and launches on the operands' GPU."""
    env = _env(tmp_path / "cache", KERNELS_BACKENDS="triton", KERNELS_FASTPATH=fastpath)
    out = _last_json(run_python(INTERLEAVED, env))
    if fastpath == "build":
        assert out["fastpath"] == "loaded"
    for call in out["calls"]:
        assert call["out"] == call["call"].split("@")[1] and call["current"] == 0, call
        assert call["err"] < 1e-2, call
        assert call["other_after"] == call["other_before"] == call["other_peak"], call
    assert out["stats"]["tunes"] == 2 and out["stats"]["disk_hits"] == 2    # one tune per problem, for both GPUs


# -- c: two processes, one per GPU, meet one new problem ------------------------------------------------------------
RANK = textwrap.dedent("""
    import json, os, pathlib, sys, time, torch, kernels
    rank, meet = int(os.environ["TEST_RANK"]), pathlib.Path(os.environ["TEST_BARRIER"])
    torch.cuda.set_device(rank)
    _ = kernels.mm                                     # the dispatch chain imported before the meeting
    torch.manual_seed(rank)
    a = torch.randn(1536, 640, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(640, 896, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    (meet / f"ready.{rank}").touch()
    deadline = time.monotonic() + 120
    while len(list(meet.glob("ready.*"))) < 2:
        if time.monotonic() > deadline:
            sys.exit("the other process never came")
        time.sleep(0.002)
    start = time.time()
    c = kernels.mm(a, b)
    torch.cuda.synchronize()
    end = time.time()
    ref = a.double() @ b.double()
    print(json.dumps({"rank": rank, "out": str(c.device), "start": start, "end": end,
                      "err": float((c.double() - ref).norm() / ref.norm()), "winner": kernels.explain(a, b).winner,
                      "stats": kernels.stats()}))
""")


def test_two_ranks_meeting_one_new_problem_tune_it_once(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    procs = [start_python(RANK, _env(tmp_path / "cache", TEST_RANK=str(rank), TEST_BARRIER=str(meet)))
             for rank in (0, 1)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [o["out"] for o in outs] == ["cuda:0", "cuda:1"] and all(o["err"] < 1e-2 for o in outs)
    tuner, waiter = sorted(outs, key=lambda o: -o["stats"]["tunes"])
    assert tuner["stats"]["tunes"] == 1 and waiter["stats"]["tunes"] == 0, outs
    assert waiter["stats"]["disk_hits"] == 1 and tuner["stats"]["disk_hits"] == 0
    assert waiter["winner"] == tuner["winner"]
    assert waiter["start"] < tuner["end"], "the two calls did not overlap: the test met no concurrent tune"


# -- d: bench.model_ddp, one GPU and two ----------------------------------------------------------------------------
SMALL = ["--hidden", "256", "--intermediate", "512", "--head-dim", "64", "--layers", "1", "--tokens", "256",
         "--dtype", "bf16", "--seconds", "0.2", "--rounds", "1", "--timeout", "300"]


def _ddp_run(tmp_path, gpus: int) -> tuple[dict, dict]:
    path = tmp_path / f"ddp{gpus}.jsonl"
    # KERNELS_PRESET=fast: the performance model's top 5 per backend, a shorter tune; what is counted is the same
    proc = run_module("bench.model_ddp", SMALL + ["--gpus", str(gpus), "--json", str(path)],
                      _env(tmp_path / f"cache{gpus}", KERNELS_PRESET="fast"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], {r["variant"]: r for r in lines[1:]}


def test_model_ddp_two_gpus_tune_each_problem_once_as_one_gpu_does(tmp_path):
    """The first step on one GPU and on two, each from a fresh cache: the two ranks together tune exactly the
    problems one GPU tunes, each rank loading from disk what the other tuned."""
    start = time.perf_counter()
    run1, one = _ddp_run(tmp_path, 1)
    run2, two = _ddp_run(tmp_path, 2)
    assert run1["world_size"] == 1 and run2["world_size"] == 2 and run2["backend"] == "nccl"
    assert run2["multicast_env"] == MULTICAST_OFF and len(run2["devices"]) == 2
    for records in (one, two):
        assert records["eager"]["status"] == records["patch"]["status"] == "ok", records
        assert records["patch"]["loss_err"] < 2e-2 and records["patch"]["grad_err"] < 1e-1
    problems = one["patch"]["first_step_tunes"]
    assert problems >= 4                                         # qkv, o, gate/up, down forward; their backwards
    ranks = two["patch"]["cold_stats_by_rank"]
    assert sum(s.get("tunes", 0) for s in ranks) == problems, ranks
    assert sum(s.get("disk_hits", 0) for s in ranks) == problems, ranks
    assert two["patch"]["tokens_per_s"] == pytest.approx(256 * 2 / (two["patch"]["ms"] * 1e-3))
    print(f"\nfirst step, patch: 1 GPU {one['patch']['cold_s']:.2f} s, 2 GPUs {two['patch']['cold_s']:.2f} s "
          f"(by rank {two['patch']['cold_s_by_rank']}); {problems} problems; both runs "
          f"{time.perf_counter() - start:.0f} s")


# -- a CUTLASS kernel launched for a GPU that is not current --------------------------------------------------------
CUTLASS_ON_1 = textwrap.dedent("""
    import json, torch
    from backends import get_backend
    from kernels.core.problem import GemmProblem
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    a = torch.randn(512, 1024, device="cuda:1", dtype=torch.bfloat16)
    b = torch.randn(1024, 768, device="cuda:1", dtype=torch.bfloat16)
    problem = GemmProblem.from_tensors("mm", a, b)
    backend = get_backend("cutlass")
    with torch.cuda.device(1):                  # built and loaded as a tune on cuda:1 would
        choice = next(c for c in backend.choices(problem)[0] if "coop" in c.name)
        backend.prebuild([(problem, [choice])])
        outcome = backend.build(problem, [choice])[0]
    assert outcome.runner is not None, outcome.error
    ref = a.double() @ b.double()
    errs = []
    for _ in range(3):                          # launched as the warm table calls it: cuda:0 current
        c = outcome.runner.launch(a, b)
        torch.cuda.synchronize(1)
        errs.append(float((c.double() - ref).norm() / ref.norm()))
    print(json.dumps({"errs": errs, "out": str(c.device), "current": torch.cuda.current_device(),
                      "choice": choice.name, "other": torch.cuda.max_memory_allocated(0)}))
""")


def test_a_cutlass_kernel_launches_on_its_gpu_when_another_is_current(tmp_path):
    """The CUDA runtime launches into the current device's context: CUTLASS's launch makes its operands' current."""
    out = _last_json(run_python(CUTLASS_ON_1, _env(tmp_path / "cache")))
    assert out["out"] == "cuda:1" and out["current"] == 0 and out["other"] == 0, out
    assert all(e < 1e-2 for e in out["errs"]), out


# -- kernels.patch's fused blocks on a GPU that is not current ------------------------------------------------------
FUSED_ON_1 = textwrap.dedent("""
    import copy, json, torch, kernels
    from backends import fused_triton
    from bench.model_def import build_model, model_input
    from kernels.dispatch import fused
    fused.FUSE_MIN_ELEMENTS = 1                 # the grad path fused too at this size
    torch.cuda.set_device(0)
    base = build_model(1024, 2816, 1, 128, "bf16", "cuda:1")
    patched = kernels.patch(copy.deepcopy(base))
    x = model_input(64, 1024, "bf16", "cuda:1")

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    errs = []
    with torch.no_grad():
        for _ in range(2):                      # the first call checks the blocks, the second is a warm call
            errs.append(rel(patched(x), base(x)))
    outs, grads = [], []
    for model in (base, patched):
        out = model(x)
        out.float().square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    errs.append(rel(outs[1], outs[0]))
    errs += [rel(grads[1][n], grads[0][n]) for n in grads[0]]
    torch.cuda.synchronize(1)
    print(json.dumps({"errs": errs, "current": torch.cuda.current_device(), "fused": kernels.stats()["fused_blocks"],
                      "devices": sorted({key[1] for key in fused_triton._compiled}),
                      "compiled": all(v is not None for v in fused_triton._compiled.values()),
                      "other": torch.cuda.max_memory_allocated(0)}))
""")


def test_fused_blocks_launch_on_their_gpu_when_another_is_current(tmp_path):
    """The fused kernels' binaries load into, and launch on, the activations' GPU (cuda:1) while cuda:0 is current,
    forward without grad and forward + backward, as eager computes them there."""
    out = _last_json(run_python(FUSED_ON_1, _env(tmp_path / "cache", KERNELS_BACKENDS="aten")))
    assert out["current"] == 0 and out["other"] == 0 and out["devices"] == [1] and out["compiled"], out
    assert out["fused"] == 3, out           # three blocks, checked once (training mode, bf16, on a GPU)
    assert all(e < 5e-2 for e in out["errs"]), out
