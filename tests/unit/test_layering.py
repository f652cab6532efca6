"""The package's layering (docs/ARCHITECTURE.md): import-linter's contracts, no imports inside functions, and a
light `kernels.core`."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

# imported where used, on purpose: optional extras, and Triton, which reads TRITON_INTERPRET when it is first imported
# (bench.compare sets it on a machine without a GPU after `kernels` is already imported)
DEFERRED = {"matplotlib", "rich", "tqdm", "redis", "hypothesis", "triton"}


def _function_level_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    names = [sub.module or ""]
                elif isinstance(sub, ast.Import):
                    names = [a.name for a in sub.names]
                else:
                    continue
                found += [f"{path.relative_to(REPO)}:{sub.lineno} {n}" for n in names
                          if n.split(".")[0] not in DEFERRED]
    return found


# bench's CLIs import kernels (and through it Triton) inside main() on purpose: without a GPU they must set
# TRITON_INTERPRET first; torch._dynamo is loaded only for the Inductor column
@pytest.mark.parametrize("package", ["kernels", "backends", "tools", "experiments"])
def test_no_imports_inside_functions(package):
    found = [hit for p in sorted((REPO / package).rglob("*.py")) for hit in _function_level_imports(p)]
    assert not found, "imports inside functions (move them to the module top, or break the cycle they dodge):\n" + \
        "\n".join(found)


def test_import_linter_contracts_hold():
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    proc = subprocess.run([lint, "--config", str(REPO / ".importlinter")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("module", ["kernels", "kernels.core.problem", "kernels.core.config", "kernels.core.fsutil"])
def test_core_imports_stay_light(module):
    """Importing a record or the package root does not load the dispatch, tuning or backend chain."""
    code = (f"import sys, {module}; heavy = sorted(m for m in sys.modules if m.startswith(('kernels.dispatch', "
            f"'kernels.tune', 'kernels.store', 'backends', 'triton'))); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import {module} loaded {out.stdout.strip()}"


def test_compile_worker_does_not_import_torch():
    """Compile workers start per build batch: `backends.triton_worker` must stay free of torch."""
    code = "import sys, backends.triton_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
