"""The template registry (kernels/space/families.py) is the one list of families: each entry resolves to its
implementation and kernel files, and every kernel file and Triton family object belongs to an entry."""
import importlib

import pytest

from backends import triton_templates
from kernels.core.problem import OPS
from kernels.space import families
from backends.fused_triton import FUSED_TEMPLATES
from kernels.space.families import FAMILIES, TEMPLATES_ROOT


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_resolves(family):
    assert family.backend in ("aten", "triton", "cutlass", "padded")
    assert family.ops and set(family.ops) <= set(OPS)
    if family.backend != "aten":
        module, attr = family.implementation.split(":")
        assert getattr(importlib.import_module(module), attr) is not None
    if family.backend in ("triton", "cutlass"):
        assert family.kernel_files, f"{family.name} renders no kernel file"
    for rel in family.kernel_files:
        assert (TEMPLATES_ROOT / rel).is_file(), f"{family.name}: missing {rel}"
    assert families.backend_of(family.name) == family.backend


def test_every_kernel_file_belongs_to_a_family():
    """... or to a fused block of kernels.patch (backends.fused_triton)"""
    used = {rel for f in FAMILIES for rel in f.kernel_files}
    used |= {f"triton/{name}" for name in FUSED_TEMPLATES.values()}
    on_disk = {p.relative_to(TEMPLATES_ROOT).as_posix() for p in TEMPLATES_ROOT.rglob("*.jinja")}
    assert on_disk - used == set(), f"kernel files no family renders: {sorted(on_disk - used)}"


def test_triton_family_objects_claim_the_registry_names():
    for name in triton_templates.templates():
        family = triton_templates.family(name)
        assert name in family.templates, f"{type(family).__name__} does not list {name}"
