"""The commands that build into or read the cache directory refuse to run when it fails its checks (a call would fall
back to a private temporary cache, and a command's work there -- kernels, selections, the C++ table, an import --
would be gone at exit); the ones that only describe the machine or read their own file still run."""
import pytest

from kernels import __main__ as cli

NEEDS_THE_CACHE = [["fastpath", "build"], ["warmup", "--dtypes", "int8"], ["tune", "LIST", "--dry-run"],
                   ["cache", "list"], ["cache", "import", "bundle.tar.gz"], ["lut", "export"]]


@pytest.fixture
def cache_is_a_file(tmp_path, monkeypatch):
    path = tmp_path / "not-a-folder"
    path.write_text("")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(path))
    return path


@pytest.mark.parametrize("argv", NEEDS_THE_CACHE, ids=lambda argv: " ".join(argv[:2]))
def test_a_command_that_needs_the_cache_refuses_an_unusable_one(argv, cache_is_a_file, tmp_path, capsys):
    listed = tmp_path / "one.csv"
    listed.write_text("m,n,k,dtype,layout\n32,48,64,fp16,nn\n")
    argv = [str(listed) if a == "LIST" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"the cache directory {cache_is_a_file} (KERNELS_CACHE_DIR) is not a directory" in err
    assert cache_is_a_file.read_text() == ""


def test_describing_commands_still_run_and_info_says_what_is_wrong(cache_is_a_file, tmp_path, capsys):
    table = tmp_path / "lut.json"
    table.write_text('{"version": 1, "entries": []}')
    assert cli.main(["lut", "check", str(table)]) == 0
    (tmp_path / "store").mkdir()
    assert cli.main(["lut", "export", "--store", str(tmp_path / "store"), "-o", str(tmp_path / "out.json")]) == 0
    assert cli.main(["config"]) == 0
    capsys.readouterr()
    with pytest.warns(UserWarning):
        assert cli.main(["info"]) == 0
    assert f"cache dir: {cache_is_a_file} is not a directory: calls use a private temporary cache" in \
        capsys.readouterr().out


WRITES_THE_CACHE = [["fastpath", "build"], ["warmup", "--dtypes", "int8"], ["tune", "LIST"],
                    ["cache", "import", "bundle.tar.gz"], ["cache", "prune", "--stale"], ["cache", "clear", "--yes"],
                    ["cache", "verify", "--fix"]]


@pytest.mark.parametrize("argv", WRITES_THE_CACHE, ids=lambda argv: " ".join(argv[:2] + argv[2:][:1]))
def test_a_command_whose_work_is_written_there_refuses_a_cache_it_cannot_write(argv, tmp_path, monkeypatch, capsys):
    """os.access stands in for a read-only file system (a root test process may write a 0500 folder)."""
    import kernels.commands as commands

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(cache))
    real = commands.os.access
    monkeypatch.setattr(commands.os, "access", lambda p, mode: False if str(p) == str(cache) else real(p, mode))
    listed = tmp_path / "one.csv"
    listed.write_text("m,n,k,dtype,layout\n32,48,64,fp16,nn\n")
    assert cli.main([str(listed) if a == "LIST" else a for a in argv]) == 2
    assert f"the cache directory {cache} (KERNELS_CACHE_DIR) cannot be written" in capsys.readouterr().err
    # reading it still works
    assert cli.main(["cache", "list"]) == 0
    assert cli.main(["tune", str(listed), "--dry-run"]) == 0


def test_every_top_level_entry_kernels_makes_is_one_cache_clear_knows():
    """cache clear removes CACHE_ENTRIES only: a new top-level folder made anywhere must join the list, or clear
    would leave it behind."""
    import re

    from kernels.core.cache_root import CACHE_ENTRIES
    from tests.helpers import REPO

    made = set()
    for path in [*(REPO / "kernels").rglob("*.py"), *(REPO / "backends").rglob("*.py")]:
        text = path.read_text()
        made |= set(re.findall(r'cache_root\(\) / "([^"/]+)', text))
        made |= {sub.split("/")[0] for sub in re.findall(r'^\s+subdir = "([^"]+)"', text, re.M) if sub}
    assert made and made <= set(CACHE_ENTRIES), made - set(CACHE_ENTRIES)


def test_an_entry_of_the_cache_that_is_not_a_folder_or_cannot_be_written_is_named(tmp_path, monkeypatch, capsys):
    """The top folder may pass while `selections` is a plain file (every command traced back on it) or cannot be
    written (a tune's selections died with the process)."""
    import kernels.commands as commands

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(cache))
    listed = tmp_path / "one.csv"
    listed.write_text("m,n,k,dtype,layout\n32,48,64,fp16,nn\n")
    (cache / "selections").write_text("")
    for argv in (["tune", str(listed)], ["cache", "list"], ["cache", "verify", "--fix"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "(KERNELS_CACHE_DIR) holds selections, which is not a folder (`python -m kernels cache clear` " \
               "removes it)" in err
    assert err.startswith("python -m kernels cache verify: error:")
    assert cli.main(["cache", "clear", "--yes"]) == 0          # the repair is not refused
    assert not (cache / "selections").exists()
    (cache / "selections").mkdir()
    real = commands.os.access
    monkeypatch.setattr(commands.os, "access",
                        lambda p, mode: False if str(p) == str(cache / "selections") else real(p, mode))
    assert cli.main(["tune", str(listed)]) == 2
    assert "(KERNELS_CACHE_DIR) cannot be written in selections" in capsys.readouterr().err
    assert cli.main(["cache", "list"]) == 0
