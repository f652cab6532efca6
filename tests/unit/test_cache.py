"""Selection store: atomic and corruption-tolerant; settings read lazily and validated (across processes:
tests/interp/test_cache_processes.py)."""
import json

import pytest
import torch

import kernels
from kernels.store.selections import SelectionStore
from kernels.core.choice import Choice
from kernels.core.selection import Selection
from tests.helpers import problem


def selection(winner="aten_mm"):
    return Selection(problem=problem(), winner=winner, choices={winner: Choice("aten", winner, "bf16")},
                     timings={winner: 0.5, "triton_mm_x": "compile failed: boom"}, created=1.0,
                     stage_seconds={"build": 0.25, "first_pass": 0.125})


def test_put_get_roundtrip_and_key_mismatch(tmp_path):
    store = SelectionStore(tmp_path)
    store.put("k1", selection())
    got = store.get("k1")
    assert got.winner == "aten_mm" and got.source == "disk" and got.timings["triton_mm_x"].startswith("compile")
    assert got.stage_seconds == {"build": 0.25, "first_pass": 0.125}
    assert store.get("k2") is None


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", json.dumps({"key": "k1", "selection": {"schema": 99}}),
                                     json.dumps({"key": "k1", "selection": {"schema": 1, "winner": "x"}})])
def test_corrupt_entry_is_a_miss(tmp_path, content):
    store = SelectionStore(tmp_path)
    store.put("k1", selection())
    store.path("k1").write_text(content)
    with pytest.warns(UserWarning, match="ignoring"):
        assert store.get("k1") is None


def test_a_symbolic_link_in_an_entrys_place_is_a_miss_and_the_next_write_replaces_it(tmp_path):
    """Nothing in the cache is a link (`cache verify` says so); the store's reader does not follow one either, even
    to a valid entry, and a put replaces the link itself, never what it points to."""
    store = SelectionStore(tmp_path / "store")
    store.put("k1", selection())
    target = tmp_path / "elsewhere.json"
    store.path("k1").rename(target)
    store.path("k1").symlink_to(target)
    with pytest.warns(UserWarning, match="ignoring unreadable selection cache entry"):
        assert store.get("k1") is None
    store.put("k1", selection("aten_addmm"))
    assert not store.path("k1").is_symlink() and store.get("k1").winner == "aten_addmm"
    assert json.loads(target.read_text())["selection"]["winner"] == "aten_mm"     # what it pointed to: untouched


def test_no_temp_files_left_behind(tmp_path):
    store = SelectionStore(tmp_path)
    for i in range(5):
        store.put(f"k{i}", selection())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_config_reads_environment_lazily_and_validates(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten, triton")
    assert kernels.config.backends == ("aten", "triton")
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,bogus")
    with pytest.raises(ValueError, match="KERNELS_BACKENDS"):
        _ = kernels.config.backends
    kernels.config.backends = ("aten",)
    assert kernels.config.backends == ("aten",)
    monkeypatch.setenv("KERNELS_PRESET", "fast")
    assert kernels.config.search_space == "exhaustive"
    assert torch.is_tensor(torch.zeros(1))
