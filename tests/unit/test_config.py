"""The settings table (kernels/core/config.py): bad values fail with a ValueError naming the variable or attribute and
what is allowed, the README carries the generated table, and no other module reads our environment variables."""
import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels.core import config as config_mod
from kernels.core.config import SETTINGS, config, readme_settings, settings_markdown
from kernels.core.errors import SettingError
from tests.helpers import REPO, run_python

# (variable, bad value): the probes first (today: "min() arg is an empty sequence" for nan, -1/0/nan accepted
# as a budget, "," silently aten only), then one of each kind: positive integers, enumerations, flags, lists
BAD_ENVIRONMENT = [
    ("KERNELS_TIE_TOLERANCE", "nan"), ("KERNELS_TIE_TOLERANCE", "-0.1"), ("KERNELS_TIE_TOLERANCE", "1"),
    ("KERNELS_BENCH_MS", "-1"), ("KERNELS_BENCH_MS", "0"), ("KERNELS_BENCH_MS", "nan"), ("KERNELS_BENCH_MS", "inf"),
    ("KERNELS_BACKENDS", ","), ("KERNELS_BACKENDS", "aten,bogus"),
    ("MAX_JOBS", "0"), ("MAX_JOBS", "two"), ("MAX_JOBS", "1.5"),
    ("KERNELS_PRESET", "fastest"), ("KERNELS_FASTPATH", "sometimes"), ("KERNELS_VERBOSE", "2"),
    ("KERNELS_ONLY", ","), ("KERNELS_SKIP", "("), ("KERNELS_DYNAMIC", ","), ("KERNELS_DYNAMIC", "m=0"),
    ("KERNELS_DYNAMIC", "x"), ("KERNELS_CUTLASS_BUILD", "later"),
    ("KERNELS_CACHE_DIR", "~no-such-user-of-kernels/cache"), ("KERNELS_RECORD", "~no-such-user-of-kernels/t.jsonl"),
    # an attacker's probe: tracebacks from re and int(), values past any tensor or worker count
    ("KERNELS_SKIP", "a{99999999999}"), ("KERNELS_ONLY", "(" * 3000), ("MAX_JOBS", "9" * 23), ("MAX_JOBS", "\u0663"),
    ("KERNELS_DYNAMIC", "m=" + "9" * 23), ("KERNELS_DYNAMIC", "m=1e300"),
]

BY_ENV = {s.env: s.name for s in SETTINGS}


@pytest.mark.parametrize("env,value", BAD_ENVIRONMENT)
def test_a_bad_environment_value_names_its_variable_and_what_is_allowed(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=rf"^{env}=.*allowed") as caught:
        getattr(config, BY_ENV[env])
    assert isinstance(caught.value, SettingError)
    with pytest.raises(SettingError, match=env):
        config.validate()


@pytest.mark.parametrize("env,value", [("KERNELS_TIE_TOLERANCE", "nan"), ("KERNELS_BENCH_MS", "-1"),
                                       ("KERNELS_BENCH_MS", "0"), ("KERNELS_BACKENDS", ",")])
def test_a_call_that_tunes_fails_on_a_bad_setting_before_building(monkeypatch, env, value):
    """The issue's probes, through kernels.mm (on CPU through the interpreter: a call that tunes)."""
    if not config_mod.interpret_mode():
        pytest.skip("on CPU a call tunes only with TRITON_INTERPRET=1")
    monkeypatch.setenv(env, value)
    a = torch.randn(8, 8, dtype=torch.float16)
    before = kernels.stats()
    with pytest.raises(ValueError, match=env):
        kernels.mm(a, a)
    after = kernels.stats()
    assert (after["tunes"], after["compiles"]) == (before["tunes"], before["compiles"])


@pytest.mark.parametrize("name,value", [
    ("tie_tolerance", math.nan), ("tie_tolerance", 1.5), ("bench_budget_ms", -1), ("bench_budget_ms", 0.0),
    ("bench_budget_ms", math.inf), ("bench_budget_ms", True), ("backends", ()), ("backends", ("aten", "npu")),
    ("max_jobs", 0), ("max_jobs", 2.0), ("preset", "slow"), ("fastpath", "on"), ("verbose", "loud"),
    ("cutlass_build", "eventually"),
    ("only", "("), ("dynamic", "q"), ("dynamic", "m=16;m=32"), ("dynamic", (("m", (16,)), ("m", (32,)))),
    ("dynamic", {"m": (16,), "M": (32,)}),
    ("cache_dir", ""), ("search_space", "huge"), ("benchmark_space", 0), ("perf_model", "magic"),
    # an environment variable cannot hold a NUL; set in code, a path with one failed at each use, unnamed
    ("cache_dir", "/tmp/x\0y"), ("lut", "/tmp/x\0y.json"), ("record", "/tmp/x\0y.jsonl"), ("lut", 5)])
def test_a_bad_value_set_in_code_names_the_attribute_and_keeps_the_old_value(name, value):
    before = getattr(config, name)
    with pytest.raises(SettingError, match=rf"^kernels\.config\.{name} = .*allowed"):
        setattr(config, name, value)
    assert getattr(config, name) == before


def test_values_set_in_code_win_until_reset(monkeypatch):
    monkeypatch.setenv("KERNELS_BENCH_MS", "7.5")
    assert config.bench_budget_ms == 7.5
    config.bench_budget_ms = "12"
    assert config.bench_budget_ms == 12.0
    config.bench_budget_ms = None                      # forgets the value set in code
    assert config.bench_budget_ms == 7.5
    config.backends = "Aten, triton,aten"
    assert config.backends == ("aten", "triton")
    config.reset()
    monkeypatch.delenv("KERNELS_BENCH_MS")
    assert config.bench_budget_ms == 40.0 and config.backends == ("aten", "triton", "cutlass", "padded")


def test_unknown_and_former_settings_are_attribute_errors():
    with pytest.raises(AttributeError, match="no setting 'bench_ms'"):
        config.bench_ms = 3
    with pytest.raises(AttributeError, match="RETIME_TOP"):
        _ = config.retime_top
    with pytest.raises(AttributeError, match=r"Dynamic\(pool="):
        config.dynamic_pool = 2


def test_a_former_variable_still_set_warns_once_where_it_went():
    code = "import warnings, kernels\nwarnings.simplefilter('always')\nkernels.config.backends\nkernels.config.lut\n"
    proc = run_python(code, {"KERNELS_RETIME_TOP": "5"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("KERNELS_RETIME_TOP is no longer read") == 1 and "RETIME_TOP" in proc.stderr


def test_few_settings_each_documented_once():
    # issue 25 kept 12; issue 26 added KERNELS_MAX_PROBLEMS (the bounded warm table), issue 27 KERNELS_CUTLASS_BUILD
    # (how kernels a tune needs get built), issue 29 KERNELS_RECORD (the problem trace) and the shared store's three
    # (KERNELS_STORE, its wait and its lock's lifetime), issue 28 KERNELS_DUEL (where a large problem's duel runs).
    # Each new one joins the table.
    assert len(SETTINGS) <= 19
    assert len({s.env for s in SETTINGS}) == len(SETTINGS) and all(s.doc and s.default_text for s in SETTINGS)
    table = settings_markdown()
    assert all(table.count(f"| `{s.env}` |") == 1 for s in SETTINGS)


def test_readme_carries_the_generated_table():
    readme = (REPO / "README.md").read_text()
    section = readme_settings(readme)
    if section is None:
        pytest.skip("README.md has no <!-- settings:begin --> ... <!-- settings:end --> section yet")
    assert section == settings_markdown(), "regenerate it: python -m kernels config --readme README.md"


def test_cli_prints_the_table():
    proc = subprocess.run([sys.executable, "-m", "kernels", "config"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == settings_markdown()


# -- nothing outside config.py reads our environment variables -------------------------------------------------
OURS = ("KERNELS_", "MAX_JOBS", "CUTLASS_DIR")


def _ours(node, constants) -> str | None:
    """The variable name when `node` is one of ours: a string constant, or a module-level name bound to one."""
    value = node.value if isinstance(node, ast.Constant) else constants.get(node.id) if isinstance(node, ast.Name) \
        else None
    return value if isinstance(value, str) and value.startswith(OURS) else None


def environment_reads(source: str) -> list[str]:
    """'line: NAME' for each read of one of our variables: x.get(NAME), getenv(NAME), x[NAME] (read), NAME in x."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body
                 if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                 for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("get", "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            keys.append(node.left)
        found += [f"{node.lineno}: {var}" for var in filter(None, (_ours(k, constants) for k in keys))]
    return found


def test_the_read_finder_finds_reads_and_not_writes():
    assert environment_reads("import os\nos.environ.get('KERNELS_X')\n") == ["2: KERNELS_X"]
    assert environment_reads("import os\nV = 'MAX_JOBS'\nx = os.environ[V]\n") == ["3: MAX_JOBS"]
    assert environment_reads("from os import getenv\ngetenv('CUTLASS_DIR')\n'KERNELS_Y' in env\n") == \
        ["2: CUTLASS_DIR", "3: KERNELS_Y"]
    assert environment_reads("import os\nos.environ['KERNELS_X'] = '1'\nenv = dict(KERNELS_X='1')\n"
                             "os.environ.get('TRITON_INTERPRET')\n") == []


def test_no_module_but_config_reads_our_environment_variables():
    reads = {}
    for folder in ("kernels", "backends", "bench", "tools", "experiments"):
        for path in sorted((REPO / folder).rglob("*.py")) if (REPO / folder).is_dir() else []:
            if path.resolve() == Path(config_mod.__file__).resolve():
                continue
            found = environment_reads(path.read_text())
            if found:
                reads[str(path.relative_to(REPO))] = found
    assert reads == {}, f"read these through kernels.core.config: {reads}"


def test_a_home_relative_path_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KERNELS_CACHE_DIR", "~/kc")
    assert config.cache_dir == str(tmp_path / "kc")


def test_only_a_change_to_what_selection_depends_on_calls_the_selection_hooks(monkeypatch):
    calls = []
    monkeypatch.setattr(config_mod, "_on_selection_change", [lambda: calls.append(1)])
    cfg = config_mod.Config()
    cfg.verbose = True                     # not a selection setting
    assert calls == []
    cfg.backends = ("aten",)
    assert len(calls) == 1
    cfg.backends = "aten"                  # the same value, parsed
    assert len(calls) == 1
    cfg.only = ("^triton_mm_",)
    cfg.backends = None                    # forgotten: the environment's value applies again
    assert len(calls) == 3
    cfg.reset()                            # forgets `only`
    assert len(calls) == 4
    cfg.verbose = True
    cfg.reset()                            # nothing selection depends on was set
    assert len(calls) == 4


def test_the_size_hint_bound_is_the_problems():
    """kernels.core.dynamic_spec keeps its own copy of MAX_DIM (kernels.core.problem imports torch, which the
    settings must not): the two agree."""
    from kernels.core import dynamic_spec, problem

    assert dynamic_spec.MAX_DIM == problem.MAX_DIM


def test_temporarily_sets_settings_for_a_block_and_puts_back_what_was_set_in_code():
    config.duel = "calls"
    with config.temporarily(duel="loop", max_jobs=3):
        assert (config.duel, config.max_jobs) == ("loop", 3)
    assert config.duel == "calls" and "max_jobs" not in config._overrides
    with pytest.raises(SettingError, match="kernels.config.duel"):
        with config.temporarily(duel="sometimes"):
            pass
    assert config.duel == "calls"
