"""Native launches (backends/triton_launch.attach_native): every Triton family describes its launches as data for the
C++ table. On the CPU no kernel can be launched natively, so these tests check the description against what the
Python path launches: same kernels, grids and arguments, with the operand pointers in the right places."""
import pytest
import torch

from backends.triton_launch import CompiledHandle, KernelCall, Operand, epilogue_operands, native_launch
from backends.triton_templates import family
from kernels.native import fastpath
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem

HIDDEN_PARAMS = 2           # global and profile scratch pointers, appended to every kernel's arguments


class RecordingHandle(CompiledHandle):
    """A compiled-kernel stand-in: records what the Python path launches, and offers a native layout."""

    def __init__(self, index: int, arg_types: tuple[str, ...], scratch: int = 0):
        self.kernel = None
        self.device_index = 0
        self.device = torch.device("cpu")
        self.arg_types = arg_types
        self.function = 1000 + index
        self.scratch = scratch
        self.launches: list[tuple[tuple, tuple]] = []

    def bind(self, grid):
        def run(*args):
            self.launches.append((grid, args))

        return run

    def native_layout(self):
        return (self.function, 128, 4096, self.scratch), ""


class FakeNative:
    def __init__(self, device, stream, m, n, out_dtype, steps, fallback, keepalive, scaling=""):
        self.device, self.stream, self.m, self.n, self.out_dtype = device, stream, m, n, out_dtype
        self.steps, self.fallback, self.keepalive, self.scaling = steps, fallback, keepalive, scaling


class FakeModule:
    def native(self, *args):
        return FakeNative(*args)


@pytest.fixture
def fake_table(monkeypatch):
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    monkeypatch.setattr(fastpath, "_loaded", [FakeModule()])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)


def tensor(shape, dtype, col=False):
    if dtype == torch.int8:
        t = torch.randint(-8, 8, shape[::-1] if col else shape, dtype=dtype)
    else:
        t = torch.randn(shape[::-1] if col else shape).to(dtype)
    return t.t() if col else t


CASES = [  # template, dtype, (m, n, k), B column-major
    ("triton_mm", torch.float16, (17, 33, 64), False),
    ("triton_int8_mm", torch.int8, (32, 48, 64), True),
    ("triton_tma_mm", torch.float16, (64, 64, 64), False),
    ("split_k", torch.float16, (32, 32, 4096), False),
    ("decompose_k", torch.float16, (32, 32, 4096), False),
    ("triton_kmajor_int8_mm", torch.int8, (64, 64, 128), False),
    ("triton_padded_mm", torch.float16, (17, 33, 65), False),
    ("triton_padded_int8_mm", torch.int8, (17, 33, 65), False),
]


def launcher(template, a, b, scratch=0):
    problem = GemmProblem.from_tensors("int_mm" if a.dtype == torch.int8 else "mm", a, b)
    fam = family(template)
    choices, skipped = fam.choices(problem, template, "default")
    assert choices, skipped
    choice = choices[0]
    specs = fam.specs(problem, choice)
    handles = [RecordingHandle(i, tuple(arg.type for arg in spec.args), scratch) for i, spec in enumerate(specs)]
    return fam.launcher(problem, choice, specs, handles), handles


def as_values(args) -> list[int]:
    return [x.data_ptr() if isinstance(x, torch.Tensor) else int(x) for x in args]


@pytest.mark.parametrize("template,dtype,shape,b_col", CASES)
def test_native_steps_launch_what_the_python_path_launches(fake_table, template, dtype, shape, b_col):
    m, n, k = shape
    a, b = tensor((m, k), dtype), tensor((k, n), dtype, col=b_col)
    launch, handles = launcher(template, a, b)
    native = launch.native
    assert launch.direct is native and launch.native_why == ""
    assert (native.device, native.stream, native.m, native.n) == (0, 77, m, n)
    assert native.fallback is launch                  # other streams and odd outputs take the Python path

    out = launch(a, b, None)                          # the Python path, recorded
    pointers = {int(Operand.A): a.data_ptr(), int(Operand.B): b.data_ptr(), int(Operand.OUT): out.data_ptr()}
    assert len(native.steps) == len(handles)
    for step, handle in zip(native.steps, handles):
        function, gx, gy, gz, threads, shared, values, operands = step
        (grid, args), = handle.launches
        assert (function, (gx, gy, gz), threads, shared) == (handle.function, grid, 128, 4096)
        filled = list(values)
        for param, operand in operands:
            filled[param] = pointers[operand]
        assert filled == as_values(args) + [0] * HIDDEN_PARAMS
        # only the operands change between calls: every other pointer is a buffer the native launch keeps alive
        fixed = {x.data_ptr() for x in args if isinstance(x, torch.Tensor)} - set(pointers.values())
        assert fixed <= {t.data_ptr() for t in native.keepalive}


SCALED_CASES = [  # template, (m, n, k), scaling, bias, out dtype
    ("triton_scaled_mm", (20, 48, 64), "tensor", False, "bf16"),
    ("triton_scaled_mm", (20, 48, 64), "row", True, "fp16"),
    ("triton_tma_scaled_mm", (64, 64, 64), "row", False, "bf16"),
    ("triton_tma_scaled_mm", (64, 64, 64), "tensor", True, "fp32"),
    ("split_k", (32, 32, 4096), "row", True, "bf16"),
]


def scaled_operands(m, n, k, scaling, bias, out_dtype):
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()
    shapes = ((m, 1), (1, n)) if scaling == "row" else ((), ())
    scales = tuple(torch.rand(shape) + 0.5 for shape in shapes)
    epi = scales + ((torch.randn(n).to(DTYPES_BY_NAME[out_dtype]),) if bias else ())
    return a, b, epi


@pytest.mark.parametrize("template,shape,scaling,bias,out_dtype", SCALED_CASES)
def test_scaled_plans_take_the_scales_where_the_python_path_passes_them(fake_table, template, shape, scaling, bias,
                                                                        out_dtype):
    m, n, k = shape
    a, b, epi = scaled_operands(m, n, k, scaling, bias, out_dtype)
    problem = GemmProblem.from_tensors("scaled_mm", a, b, bias=bias, scaling=scaling, out_dtype=out_dtype)
    fam = family(template)
    choices, skipped = fam.choices(problem, template, "default")
    assert choices, skipped
    specs = fam.specs(problem, choices[0])
    handles = [RecordingHandle(i, tuple(arg.type for arg in spec.args)) for i, spec in enumerate(specs)]
    launch = fam.launcher(problem, choices[0], specs, handles)
    native = launch.native
    assert launch.direct is native and launch.native_why == ""
    assert (native.m, native.n, native.out_dtype, native.scaling) == (m, n, DTYPES_BY_NAME[out_dtype], scaling)

    out = launch(a, b, *epi, None)                    # the Python path, recorded
    pointers = {int(Operand.A): a.data_ptr(), int(Operand.B): b.data_ptr(), int(Operand.OUT): out.data_ptr(),
                int(Operand.SCALE_A): epi[0].data_ptr(), int(Operand.SCALE_B): epi[1].data_ptr()}
    if bias:
        pointers[int(Operand.BIAS)] = epi[2].data_ptr()
    taken = set()
    for step, handle in zip(native.steps, handles):
        _, _, _, _, _, _, values, operands = step
        (_, args), = handle.launches
        filled = list(values)
        for param, operand in operands:
            filled[param] = pointers[operand]
            taken.add(operand)
        assert filled == as_values(args) + [0] * HIDDEN_PARAMS
    assert taken == set(pointers)                     # every scale (and the bias) comes from the call


def test_epilogue_operands_follow_the_launch_order():
    assert epilogue_operands("", False) == ()
    assert epilogue_operands("", True) == (Operand.BIAS,)
    assert epilogue_operands("row", False) == (Operand.SCALE_A, Operand.SCALE_B)
    assert epilogue_operands("tensor", True) == (Operand.SCALE_A, Operand.SCALE_B, Operand.BIAS)


def test_scratch_is_allocated_per_program_and_kept_alive(fake_table):
    a, b = tensor((64, 64), torch.float16), tensor((64, 64), torch.float16)
    launch, handles = launcher("triton_tma_mm", a, b, scratch=128)
    (function, gx, gy, gz, _, _, values, _), = launch.native.steps
    scratch = [t for t in launch.native.keepalive if t.numel() == gx * gy * gz * 128]
    assert len(scratch) == 1 and values[-2] == scratch[0].data_ptr() and values[-1] == 0


def test_no_native_launch_without_the_table_or_a_compiled_kernel(monkeypatch):
    monkeypatch.setattr(fastpath, "_loaded", [None])
    a, b = tensor((17, 64), torch.float16), tensor((64, 33), torch.float16)
    launch, _ = launcher("triton_mm", a, b)
    assert not hasattr(launch, "native") and "not loaded" in launch.native_why
    monkeypatch.setattr(fastpath, "_loaded", [FakeModule()])
    monkeypatch.setenv("KERNELS_FASTPATH", "off")
    assert fastpath.loaded_module() is None           # off means off, whatever was loaded before


def test_arguments_that_do_not_fit_their_types_are_refused(fake_table):
    handle = RecordingHandle(0, ("*fp16", "i32"))
    native, why = native_launch(FakeModule(), lambda a, b, out: None, (1, 1), torch.float16,
                                [KernelCall(handle, (1, 1, 1), (Operand.A, 1 << 31))])
    assert native is None and "does not fit i32" in why
    native, why = native_launch(FakeModule(), lambda a, b, out: None, (1, 1), torch.float16,
                                [KernelCall(handle, (1, 1, 1), (Operand.A,))])
    assert native is None and "1 arguments for a kernel taking 2" in why
    native, why = native_launch(FakeModule(), lambda a, b, out: None, (1, 1), torch.float16,
                                [KernelCall(handle, (1, 1, 1), (3, 4))])
    assert native is None and "does not match its type *fp16" in why


def test_launch_hooks_count_only_when_something_is_hooked(monkeypatch):
    import triton

    from backends.triton_launch import launch_hooks_installed

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("this triton has no knobs")
    assert not launch_hooks_installed()               # an empty HookChain is truthy: it must not count
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        hook = lambda *args: None                      # noqa: E731
        chain.add(hook)
        try:
            assert launch_hooks_installed()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
        assert launch_hooks_installed()
