"""Does torch.mm's speed change after CUDA-graph captures (device_time_ms) of it or of other calls? bf16 3000x2000x1000,
the shape whose tune once measured aten at >36 us (24 us usual)."""
import gc, statistics, sys, time
import torch
from kernels.measure.timing import device_time_ms, measure, measure_together, rotation_sets
torch.manual_seed(0)
def sets_for(m, n, k, dt=torch.bfloat16):
    cnt = rotation_sets((m * k + k * n) * 2, "cuda")
    return [(torch.randn(m, k, device="cuda").to(dt), torch.randn(k, n, device="cuda").to(dt)) for _ in range(cnt)]
S = sets_for(3000, 2000, 1000)
call = lambda i: torch.mm(*S[i % len(S)])
other = sets_for(768, 768, 768)
ocall = lambda i: torch.mm(*other[i % len(other)])
print("blas", torch.backends.cuda.preferred_blas_library(), torch.__version__)
def t(): return measure(call, len(S), "cuda", 40).median_ms * 1e3
print("cold", [round(t(), 2) for _ in range(5)])
for cycle in range(12):
    g = device_time_ms(call, len(S))
    after_self = t()
    g2 = device_time_ms(ocall, len(other))
    after_other = t()
    gc.collect()
    after_gc = t()
    print(f"cycle {cycle}: gpu {g*1e3:.2f} after-self {after_self:.2f} after-other {after_other:.2f} after-gc {after_gc:.2f}", flush=True)
# mixing with the int8 and a Triton-like load: a long run of other shapes' captures
for k in (512, 1024, 4096):
    o = sets_for(1024, 8192, k)
    for _ in range(3):
        device_time_ms(lambda i: torch.mm(*o[i % len(o)]), len(o))
    print(f"after 3 captures of 1024x8192x{k}: {t():.2f}", flush=True)
torch.cuda.empty_cache()
print("after empty_cache", round(t(), 2))
