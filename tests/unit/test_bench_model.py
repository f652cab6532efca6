"""bench.model without a GPU: arguments and bad input, the model's shapes and math, the numerical difference
measures, one group's alternation with fake loops, and the report (figures, table, JSON) from fake timings. Its run
end to end on CPU: tests/interp/test_bench_model_runs.py."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench import model as bm
from bench import model_report as br
from bench import model_variants as bv
from bench.model_def import DecoderStack, ModelShapeError, RMSNorm, build_model, linear_shapes, model_input
from bench.progress import RunProgress


# -- arguments -------------------------------------------------------------------------------------------------------
def test_defaults_are_the_issue_layer_on_a_gpu(monkeypatch):
    monkeypatch.setattr(bm.torch.cuda, "is_available", lambda: True)
    args = bm.resolve([])
    assert args.device == "cuda"
    assert (args.hidden, args.intermediate, args.layers, args.head_dim, args.dtype) == (4096, 11008, 1, 128, "bf16")
    assert args.tokens == [1, 16, 128, 2048, 8192] and args.modes == ["fwd", "fwdbwd"]
    assert args.variants == ["eager", "compile", "max-autotune", "patch", "patch+compile"]
    assert args.plan == bm.LoopPlan(seconds=1.0, rounds=2, heat=1.0, stat="median")
    assert args.json is None and args.time_limit is None


def test_a_cpu_gets_a_small_layer_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(bm.torch.cuda, "is_available", lambda: False)
    args = bm.resolve([])
    assert args.device == "cpu"
    assert (args.hidden, args.intermediate, args.head_dim, args.tokens) == (256, 688, 64, [16, 64])
    assert args.variants == ["eager", "patch"] and args.plan.seconds == 0.2
    told = bm.resolve(["--hidden", "512", "--tokens", "8", "--variants", "all", "--seconds", "1"])
    assert (told.hidden, told.intermediate, told.tokens, told.plan.seconds) == (512, 688, [8], 1.0)
    assert told.variants == ["eager", "compile", "max-autotune", "patch", "patch+compile"]
    assert "not a GPU's speedups" in bm.table_title({"device": "cpu"})
    assert "speedups" not in bm.table_title({"device": "cuda"})


def test_lists_parse_and_eager_is_always_the_reference(monkeypatch):
    args = bm.resolve(["--tokens", "16, 1,16", "--mode", "fwdbwd", "--variants", "patch,compile,patch",
                       "--seconds", "0.5", "--rounds", "3", "--heat", "0", "--stat", "min", "--time-limit", "60"])
    assert args.tokens == [16, 1] and args.modes == ["fwdbwd"]
    assert args.variants == ["eager", "patch", "compile"]
    assert args.plan == bm.LoopPlan(0.5, 3, 0.0, "min") and args.time_limit == 60
    with pytest.raises(SystemExit):         # CUDA graphs off a GPU: a usage error, not three failing rows
        bm.resolve(["--cudagraphs", "--device", "cpu"])
    monkeypatch.setattr(bm.torch.cuda, "is_available", lambda: True)
    assert bm.resolve(["--cudagraphs"]).variants[-3:] == list(bv.CUDAGRAPH_VARIANTS)
    assert bm.resolve(["--variants", "patch+cudagraph", "--cudagraphs"]).variants == [
        "eager", "patch+cudagraph", "max-autotune+cudagraphs", "patch+compile+cudagraphs"]
    assert bm.groups(bm.resolve(["--tokens", "1,8", "--mode", "fwd,fwdbwd"])) == [
        ("fwd", 1), ("fwd", 8), ("fwdbwd", 1), ("fwdbwd", 8)]


@pytest.mark.parametrize("argv, says", [
    (["--tokens", "0"], "'0' is not a positive integer"), (["--tokens", "1,x"], "'x' is not a positive integer"),
    (["--tokens", ","], "--tokens names no M"), (["--mode", "bwd"], "--mode: unknown 'bwd'; allowed: fwd, fwdbwd"),
    (["--variants", "eager,turbo"], "--variants: unknown 'turbo'; allowed: eager, compile"),
    (["--hidden", "100", "--head-dim", "128"], "--hidden 100 is not a multiple of --head-dim 128"),
    (["--hidden", "0"], "must be a positive integer"), (["--layers", "-1"], "must be a positive integer"),
    (["--dtype", "int8"], "invalid choice"), (["--seconds", "0"], "must be a positive number"),
    (["--heat", "-1"], "must be a non-negative number"), (["--rounds", "0"], "must be a positive integer"),
    (["--stat", "mean"], "invalid choice"), (["--time-limit", "x"], "is not a number"),
    (["--device", "tpu"], "invalid choice")])
def test_bad_flags_are_a_usage_error_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bm.resolve(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU case")
def test_cuda_asked_for_without_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        bm.resolve(["--device", "cuda"])
    assert "torch sees no CUDA GPU" in capsys.readouterr().err
    assert bm.resolve([]).device == "cpu"


# -- the model -------------------------------------------------------------------------------------------------------
def test_the_layer_is_llama_shaped():
    model = build_model(64, 96, layers=2, head_dim=16, dtype="fp32", device="cpu")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 10 and all(m.bias is None for m in linears.values())
    for layer in ("layers.0", "layers.1"):
        for name, shape in linear_shapes(64, 96).items():
            assert tuple(linears[f"{layer}.{name}"].weight.shape) == shape
    assert model.layers[0].attn.heads == 4
    x = model_input(5, 64, "fp32", "cpu")
    assert x.shape == (1, 5, 64)
    with torch.no_grad():
        assert model(x).shape == (1, 5, 64)


def test_same_seed_same_weights_and_dtype():
    a = build_model(32, 48, 1, 16, "bf16", "cpu", seed=3)
    b = build_model(32, 48, 1, 16, "bf16", "cpu", seed=3)
    c = build_model(32, 48, 1, 16, "bf16", "cpu", seed=4)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].attn.qkv.weight, c.layers[0].attn.qkv.weight)
    assert torch.equal(model_input(3, 32, "fp32", "cpu"), model_input(3, 32, "fp32", "cpu"))


def test_attention_is_causal_over_the_tokens():
    model = build_model(32, 48, 1, 8, "fp32", "cpu")
    x = model_input(6, 32, "fp32", "cpu")
    changed = x.clone()
    changed[:, 4:] += 1.0
    with torch.no_grad():
        y, y2 = model(x), model(changed)
    torch.testing.assert_close(y[:, :4], y2[:, :4])          # earlier tokens do not see later ones
    assert not torch.allclose(y[:, 4:], y2[:, 4:])


def test_rmsnorm_and_the_gated_mlp_math():
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, eps=1e-6))
    mlp = DecoderStack(16, 24, 1, 8).layers[0].mlp
    h = torch.randn(2, 16)
    torch.testing.assert_close(mlp(h), (F.silu(h @ mlp.gate.weight.t()) * (h @ mlp.up.weight.t())) @ mlp.down.weight.t())


def test_bad_sizes_name_the_flag():
    with pytest.raises(ModelShapeError, match="--hidden 48 is not a multiple of --head-dim 32"):
        build_model(48, 64, 1, 32, "fp32", "cpu")
    with pytest.raises(ModelShapeError, match="--dtype 'int8'"):
        build_model(32, 64, 1, 16, "int8", "cpu")


# -- variants and numerics -------------------------------------------------------------------------------------------
def test_cudagraph_variants_apply_forward_at_small_m_only():
    assert bv.applies("patch+cudagraph", "fwd", 16) and bv.applies("max-autotune+cudagraphs", "fwd", 1)
    assert not bv.applies("patch+cudagraph", "fwd", 17) and not bv.applies("patch+cudagraph", "fwdbwd", 1)
    assert all(bv.applies(n, mode, 8192) for n in bv.VARIANTS for mode in bv.MODES)


def test_variants_share_the_weights_not_the_modules():
    base = build_model(32, 48, 1, 16, "fp32", "cpu")
    x = model_input(3, 32, "fp32", "cpu")
    fwd = bv.build_variant("eager", base, x, "fwd")
    train = bv.build_variant("eager", base, x, "fwdbwd")
    assert fwd.module is not base and train.module is not fwd.module
    out = fwd.step()
    assert not out.requires_grad and all(p.grad is None for p in fwd.module.parameters())
    train.step()
    grads = bv.weight_grads(train.module)
    assert set(grads) == {n for n, _ in base.named_parameters()} and all(p.grad is None for p in base.parameters())
    torch.testing.assert_close(train.step(), out)
    assert bv.worst_grad_err(bv.weight_grads(train.module), grads) == (0.0, "")     # grads set to None, not summed


def test_cudagraph_variants_refuse_cpu_and_backward():
    base = build_model(32, 48, 1, 16, "fp32", "cpu")
    x = model_input(3, 32, "fp32", "cpu")
    with pytest.raises(bv.VariantError, match="forward only"):
        bv.build_variant("max-autotune+cudagraphs", base, x, "fwdbwd")
    with pytest.raises(bv.VariantError, match="CUDA device"):
        bv.build_variant("max-autotune+cudagraphs", base, x, "fwd")
    with pytest.raises(bv.VariantError, match="CUDA device"):
        bv.build_variant("patch+compile+cudagraphs", base, x, "fwd")


def test_afirst_call_repeated_until_cuda_graph_trees_replay():
    calls = []
    step = bv.first_call_repeated(lambda: calls.append(1) or len(calls), bv.CUDAGRAPH_TREE_CALLS)
    assert step() == 3 and step() == 4


def test_max_rel_err_and_the_worst_grad():
    ref = torch.tensor([1.0, -4.0, 0.0])
    assert bv.max_rel_err(ref, ref) == 0.0
    assert bv.max_rel_err(torch.tensor([1.0, -4.0, 0.2]), ref) == pytest.approx(0.05)   # 0.2 / 4, not 0.2 / 0
    assert bv.max_rel_err(torch.tensor([0.5]), torch.tensor([0.0])) == 0.5
    with pytest.raises(ValueError, match="shapes differ"):
        bv.max_rel_err(torch.zeros(2), torch.zeros(3))
    grads = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0])}
    assert bv.worst_grad_err({"a": torch.tensor([1.0, 2.2]), "b": torch.tensor([10.5])}, grads) == (
        pytest.approx(0.1), "a")
    with pytest.raises(ValueError, match="one side only: b"):
        bv.worst_grad_err({"a": grads["a"]}, grads)


def test_stats_delta_keeps_what_moved():
    before = {"tunes": 2, "benchmarks": 10, "pass_through": {"fp64": 1}, "name": "x"}
    after = {"tunes": 5, "benchmarks": 10, "pass_through": {"fp64": 3, "sparse": 1}, "name": "y"}
    assert bm.stats_delta(before, after) == {"tunes": 3, "pass_through": {"fp64": 2, "sparse": 1}}


# -- one group with fake loops ---------------------------------------------------------------------------------------
class FakeRunner:
    """A LoopRunner that runs one step and reads back a fixed ms per variant (looked up by the loop's order)."""

    def __init__(self, ms_by_variant: dict[str, float]):
        self.ms, self.order = ms_by_variant, []

    def __call__(self, call, n_sets, seconds):
        call(0)
        name = self.current
        self.order.append(name)
        return lambda: self.ms[name]


def _setup(variants, runner, heat=0.0, rounds=2):
    base = build_model(32, 48, 1, 16, "fp32", "cpu")
    return bm.Setup(base, 32, "fp32", "cpu", variants, bm.LoopPlan(0.01, rounds, heat, "median"), runner=runner)


def test_a_group_alternates_the_variants_and_reports_a_failing_one(monkeypatch):
    runner = FakeRunner({"eager": 2.0, "compile": 1.0, "patch": 0.5})
    real_build = bv.build_variant

    def build(name, base, x, mode):
        if name == "patch":
            raise RuntimeError("kernels.patch is not here")
        v = real_build("eager", base, x, mode)
        step = v.step

        def tagged():
            runner.current = name
            return step()
        return bv.Variant(name, v.module, tagged)
    monkeypatch.setattr(bm, "build_variant", build)
    setup = _setup(["eager", "compile", "patch"], runner, rounds=3)
    results = {r.variant: r for r in bm.measure_group(setup, "fwdbwd", 4, RunProgress(1, quiet=True))}
    assert runner.order == ["eager", "compile"] * 3            # A B A B A B, the failed variant not looped
    assert results["patch"].status == "error" and "RuntimeError: kernels.patch is not here" in results["patch"].message
    eager, comp = results["eager"], results["compile"]
    assert eager.rounds_ms == [2.0] * 3 and comp.derived()["speedup"] == pytest.approx(2.0)
    assert comp.derived()["tokens_per_s"] == pytest.approx(4 / 1e-3)
    assert comp.out_err == 0.0 and comp.grad_err == 0.0 and comp.cold_s > 0    # same math as eager: no difference


def test_time_limit_skips_the_rest_and_a_loop_failure_is_an_error(monkeypatch):
    runner = FakeRunner({"eager": 1.0})
    calls = {"n": 0}

    def out_of_time():
        calls["n"] += 1
        return calls["n"] > 2                  # eager and compile start; patch does not

    real_build = bv.build_variant

    def build(name, base, x, mode):
        v = real_build("eager", base, x, mode)
        first = {"done": False}

        def step():
            runner.current = name
            if name == "compile" and first["done"]:
                raise RuntimeError("broke while looping")
            first["done"] = True
            return v.step()
        return bv.Variant(name, v.module, step)
    monkeypatch.setattr(bm, "build_variant", build)
    setup = _setup(["eager", "compile", "patch"], runner)
    results = {r.variant: r for r in bm.measure_group(setup, "fwd", 2, RunProgress(1, quiet=True), out_of_time)}
    assert results["patch"].status == "skipped" and "--time-limit" in results["patch"].message
    assert results["compile"].status == "error" and "in the timing loop: RuntimeError: broke" in \
        results["compile"].message
    assert results["eager"].status == "ok" and results["eager"].rounds_ms == [1.0, 1.0]


# -- the report from fake timings ------------------------------------------------------------------------------------
def _result(variant, tokens, rounds, mode="fwd", **kw):
    return br.VariantResult(variant, mode, tokens, "ok", rounds_ms=rounds, cold_s=1.5, **kw)


def _fake_run():
    rs = []
    for tokens, eager, patch, comp in ((1, [2.0, 2.2], [1.6, 1.8], [2.0, 2.0]), (16, [2.0, 2.0], [1.6, 1.6], [2.1, 2.1]),
                                       (128, [4.0, 4.0], [4.0, 4.0], [3.9, 4.1])):
        group = [_result("eager", tokens, eager, out_err=0.0), _result("patch", tokens, patch, out_err=2e-3,
                                                                       cold_stats={"tunes": 4}),
                 _result("compile", tokens, comp, out_err=1e-3)]
        br.attach_eager(group)
        rs += group
    bad = br.VariantResult("max-autotune", "fwd", 128, "error", message="RuntimeError: no GPU")
    train = [_result("eager", 4096, [9.0, 9.0], "fwdbwd", out_err=0.0, grad_err=0.0),
             _result("patch", 4096, [8.5, 8.7], "fwdbwd", out_err=1e-3, grad_err=4e-3, grad_err_param="mlp.down.weight")]
    br.attach_eager(train)
    return rs + [bad] + train


def test_figures_from_fake_timings():
    rs = _fake_run()
    patch1 = rs[1]
    assert patch1.eager_ms == pytest.approx(2.1) and patch1.derived() == {
        "ms": pytest.approx(1.7), "tokens_per_s": pytest.approx(1 / 1.7e-3), "speedup": pytest.approx(2.1 / 1.7)}
    assert rs[9].derived() == {"ms": None, "tokens_per_s": None, "speedup": None}     # the failed variant
    summary = {(row[0], row[1]): row for row in br.summary_rows(rs)}
    patch = summary[("fwd", "patch")]
    small = br.geomean([2.1 / 1.7, 2.0 / 1.6])
    assert patch[2] == f"{br.geomean([2.1 / 1.7, 2.0 / 1.6, 1.0]):.3f}x" and patch[3] == f"{small:.3f}x"
    assert patch[4] == "1.000x" and patch[5] == "2.00e-03" and patch[7] == "1,16,128"
    assert summary[("fwdbwd", "patch")][6] == "4.00e-03" and summary[("fwdbwd", "patch")][3] == "-"
    assert ("fwd", "eager") not in summary and ("fwd", "max-autotune") not in summary


def test_table_rows_and_the_plain_fallback():
    rs = _fake_run()
    row = dict(zip(br.HEADERS, br.table_row(rs[1])))
    assert row == {"mode": "fwd", "M": "1", "variant": "patch", "cold s": "1.50", "ms/step": "1.7000",
                   "tokens/s": "588", "vs eager": "1.235x", "out err": "2.00e-03", "grad err": "-",
                   "note": "4 tunes (0.4 s each)"}
    assert br.table_row(rs[9])[-1] == "error: RuntimeError: no GPU" and br.table_row(rs[9])[4] == "-"
    assert br.table_row(rs[-1])[-1] == "worst grad mlp.down.weight"
    text = br.plain_table(rs, "title")
    assert text.splitlines()[0] == "title" and "geomean vs eager" in text and "error: RuntimeError: no GPU" in text


def test_json_round_trip_and_table_from(tmp_path, capsys):
    rs = _fake_run()
    path = tmp_path / "run.jsonl"
    header = {"kind": "run", "gpu": "FakeGPU", "device": "cuda", "hidden": 4096, "rounds": 2, "seconds": 1.0}
    path.write_text("\n".join(json.dumps(x) for x in [header] + [r.to_json() for r in rs]) + "\n")
    record = json.loads(path.read_text().splitlines()[2])
    assert record["kind"] == "variant" and record["variant"] == "patch" and record["tokens"] == 1
    assert record["speedup"] == pytest.approx(2.1 / 1.7) and record["tokens_per_s"] == pytest.approx(1 / 1.7e-3)
    run, again = br.read_run(str(path))
    assert run == header and [r.to_json() for r in again] == [r.to_json() for r in rs]
    assert bm.main(["--table-from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FakeGPU" in out and "patch" in out and "1.235x" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert bm.main(["--table-from", str(bad)]) == 2
    assert "line 1 is not a bench.model record" in capsys.readouterr().err
