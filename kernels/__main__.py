"""`python -m kernels info`: what this machine offers the tuner, and why a backend would be left out."""
from __future__ import annotations

import argparse
import sys
from importlib import metadata


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _probe_problem(arch: int, name: str):
    """A plain aligned bf16 problem on the first device: what `available()` is asked about."""
    from kernels.problem import GemmProblem

    device = "cuda" if arch else "cpu"
    return GemmProblem(op="mm", m=1024, n=1024, k=1024, dtype="bf16", out_dtype="bf16", stride_a=(1024, 1),
                       stride_b=(1024, 1), align_a=16, align_b=16, device=device, arch=arch, device_name=name)


def info_lines() -> list[str]:
    import torch

    from backends import get_backend
    from kernels.config import ALL_BACKENDS, config
    from kernels.toolchain import toolchain

    lines = []
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        arch, name = cap[0] * 10 + cap[1], torch.cuda.get_device_name(0)
        lines.append(f"gpu:       {name} (compute capability {cap[0]}.{cap[1]}, {torch.cuda.device_count()} device(s))")
    else:
        arch, name = 0, "cpu"
        lines.append("gpu:       none (torch.cuda.is_available() is False)")
    lines.append(f"torch:     {torch.__version__} (CUDA {torch.version.cuda or '-'})")
    lines.append(f"triton:    {_version('triton')}")
    tools = toolchain()
    lines.append(f"nvcc:      {tools.nvcc} ({tools.nvcc_version})" if tools.nvcc else "nvcc:      not found")
    if tools.cutlass:
        lines.append(f"cutlass:   {tools.cutlass.root} (version {tools.cutlass.version}, from {tools.cutlass.source})")
    else:
        lines.append("cutlass:   not found")
    for line in tools.tried:
        lines.append(f"           tried {line}")
    lines.append(f"cache dir: {config.cache_dir}")
    lines.append(f"backends:  configured {','.join(config.backends)}")
    problem = _probe_problem(arch, name)
    for backend_name in ALL_BACKENDS:
        try:
            ok, why = get_backend(backend_name).available(problem)
        except Exception as e:  # noqa: BLE001 - a backend that cannot even load is reported, not fatal
            ok, why = False, f"{type(e).__name__}: {e}"
        lines.append(f"  {backend_name:8s} {'available' if ok else 'unavailable: ' + why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels")
    parser.add_argument("command", choices=["info"], help="info: print the toolchain and backends")
    parser.parse_args(argv)
    print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
