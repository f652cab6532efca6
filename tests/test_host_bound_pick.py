"""The host-bound rule of the final round: finalists whose call times are close and all set by the host are ranked
by GPU time (the H200 run that motivated it: 1024^3 bf16 picked a Triton tile at 19.4 us per call over aten's 21.9,
whose GPU time was 14.0 us against aten's 5.4, and side by side it then ran 0.84x torch.mm)."""
from kernels.autotune import host_bound_contenders


def test_close_host_bound_finalists_are_ranked_by_gpu_time():
    call = {"triton_mm": 0.0194, "aten_mm": 0.0219}
    gpu = {"triton_mm": 0.0140, "aten_mm": 0.0054}
    close = host_bound_contenders(call, gpu, 0.15)
    assert sorted(close) == ["aten_mm", "triton_mm"]
    assert min(close, key=gpu.get) == "aten_mm"


def test_split_k_keeps_winning_when_it_is_also_faster_on_the_gpu():
    call = {"split_k": 0.0233, "aten_mm": 0.0270}
    gpu = {"split_k": 0.0056, "aten_mm": 0.0065}
    assert min(host_bound_contenders(call, gpu, 0.2), key=gpu.get) == "split_k"


def test_rule_does_not_apply_to_device_bound_or_unmeasured_or_distant_finalists():
    call = {"a": 0.020, "b": 0.021}
    assert host_bound_contenders(call, {"a": 0.019, "b": 0.005}, 0.15) == []       # a is device-bound
    assert host_bound_contenders(call, {"a": None, "b": 0.005}, 0.15) == []        # capture failed for a
    assert host_bound_contenders({"a": 0.020, "b": 0.030}, {"a": 0.01, "b": 0.005}, 0.15) == []   # b not close
    assert host_bound_contenders({"a": 0.020}, {"a": 0.01}, 0.15) == []

