"""What a wheel carries: every template file (a non-editable install renders from kernels/templates)."""
import fnmatch

import pytest

from tests.helpers import REPO


def test_package_data_covers_every_template_file():
    tomllib = pytest.importorskip("tomllib")      # Python 3.11+
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "kernels.templates" in setuptools["packages"]
    source = REPO / setuptools["package-dir"]["kernels.templates"]
    patterns = setuptools["package-data"]["kernels.templates"]
    files = [p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()]
    assert files, f"no template files under {source}"
    missed = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missed, f"template files a wheel would leave out: {missed}"


def test_templates_root_falls_back_to_the_installed_copy(tmp_path, monkeypatch):
    """Installed from a wheel there is no top-level templates/ next to the package: kernels/templates is used."""
    from kernels.space import families as templates_info

    package = tmp_path / "site" / "kernels"
    (package / "templates" / "triton").mkdir(parents=True)
    monkeypatch.setattr(templates_info, "__file__", str(package / "space" / "families.py"))
    assert templates_info.templates_root() == package / "templates"
    (tmp_path / "site" / "templates").mkdir()                 # a checkout: the top-level one wins
    assert templates_info.templates_root() == tmp_path / "site" / "templates"
    assert templates_info.TEMPLATES_ROOT == REPO / "templates"
