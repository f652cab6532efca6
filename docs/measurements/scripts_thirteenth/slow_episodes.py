"""Slow episodes of torch.mm (bf16 3000x2000x1000: 23 us usual; a 40 ms measure's median once 59-72 us): what follows
them? Per-sample times (40 calls each) of aten and a Triton TMA tile, interleaved, after each of: nothing, a CUDA-graph
capture of aten (device_time_ms), of the Triton tile, a gc.collect(). Host wall vs thread CPU per sample too."""
import gc, json, os, statistics, time
import torch
from backends import get_backend
from bench.fast_preset import cuda_problem
from kernels.core.choice import Choice
from kernels.space.heuristics import GemmConfig
from kernels.measure.timing import device_time_ms, rotation_sets, user_call
out = os.environ.get("OUT", "/tmp")
p = cuda_problem("mm", "bf16", 3000, 2000, 1000)
cnt = rotation_sets((3000 * 1000 + 1000 * 2000) * 2, "cuda")
S = [(torch.randn(3000, 1000, device="cuda").bfloat16(), torch.randn(1000, 2000, device="cuda").bfloat16()) for _ in range(cnt)]
tile = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))
outcome = get_backend("triton").build(p, [tile])[0]
print("tile", outcome.choice.name, outcome.error, flush=True)
_tma = user_call(outcome.runner.launch, S)
calls = {"aten": lambda i: torch.mm(*S[i % cnt]), "tma": lambda i: _tma(i % cnt)}
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
def sample(name, n=40):
    w0, c0 = time.perf_counter(), time.thread_time()
    ev[0].record()
    for i in range(n):
        calls[name](i)
    ev[1].record(); ev[1].synchronize()
    return ev[0].elapsed_time(ev[1]) / n * 1e3, (time.perf_counter() - w0) / n * 1e6, (time.thread_time() - c0) / n * 1e6
for name in calls:
    for _ in range(20): sample(name)
events = {"none": lambda: None,
          "capture_aten": lambda: device_time_ms(calls["aten"], cnt),
          "capture_tma": lambda: device_time_ms(calls["tma"], cnt),
          "gc": gc.collect,
          "empty_cache": torch.cuda.empty_cache}
log = []
t_start = time.time()
for rep in range(25):
    for ev_name, fn in events.items():
        fn()
        for k in range(12):
            for name in (("aten", "tma") if k % 2 == 0 else ("tma", "aten")):
                g, w, c = sample(name)
                log.append({"rep": rep, "event": ev_name, "k": k, "name": name, "us": g, "wall_us": w, "cpu_us": c, "t": time.time() - t_start})
json.dump(log, open(f"{out}/slow_episodes.json", "w"))
med = {n: statistics.median(r["us"] for r in log if r["name"] == n) for n in calls}
print("medians", {n: round(v, 2) for n, v in med.items()})
for ev_name in events:
    for n in calls:
        rs = [r for r in log if r["event"] == ev_name and r["name"] == n]
        slow = [r for r in rs if r["us"] > 1.3 * med[n]]
        first = [r["us"] for r in rs if r["k"] < 2]
        print(f"{ev_name:13s} {n:5s} slow {len(slow):3d}/{len(rs)}  first-after median {statistics.median(first):.2f} max {max(first):.2f}  "
              f"slow-k {sorted(set(r['k'] for r in slow))[:12]}  slow wall/cpu {[(round(r['wall_us'],1), round(r['cpu_us'],1)) for r in slow[:4]]}")
