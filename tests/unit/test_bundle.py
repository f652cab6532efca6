"""Cache bundles and the cache commands: export then import gives the same selections; a bundle for another
environment is refused naming the part (or imported in part); tampered members, names outside the cache, links,
truncated bundles and wrong manifests are refused before anything is written; a newer local entry is kept; CUTLASS
binaries travel checked (a fake nvcc builds them: tests/fake_cutlass.py); two imports at once leave a valid store;
verify, prune and clear."""
import dataclasses
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from backends.triton import triton_version
from kernels.__main__ import main
from kernels.core.cache_root import CacheWarning
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.selection import Selection
from kernels.core.toolchain import CutlassDir, Toolchain
from kernels.space.heuristics import GemmConfig
from kernels.store import bundle, cache_admin, environment, winner_artifacts
from kernels.store.bundle import BundleError
from kernels.store.selections import SelectionStore, store_key
from kernels.tune.autotune import fingerprint
from tests import fake_cutlass
from tests.helpers import REPO, problem


def use_cache(monkeypatch, folder: Path) -> Path:
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(folder))
    return folder


def cpu_problem(m=24, n=16, k=40, **kw):
    return problem(m=m, n=n, k=k, dtype="fp16", arch=0, **kw)


def store(p, created=None, env=None, winner="aten_mm", choices=None) -> str:
    """Put a selection for `p` into the current cache under this process's key (env: fingerprint changes)."""
    choices = choices or {"aten_mm": Choice("aten", "aten_mm", p.dtype)}
    sel = Selection(problem=p, winner=winner, choices=choices, timings={n: 0.01 for n in choices},
                    created=time.time() if created is None else created)
    key = store_key(p, dict(fingerprint(config.backends), **(env or {})))
    SelectionStore().put(key, sel)
    return key


def stored() -> dict[str, tuple[str, float]]:
    """key id -> (winner, created) of every valid entry in the current cache."""
    good, _ = cache_admin.entries()
    return {e.key_id: (e.selection.winner, e.selection.created) for e in good}


def here_without_gpu():
    return dataclasses.replace(environment.here(toolchain=False), gpus=())


def read_tar(path: Path) -> tuple[dict, dict[str, bytes]]:
    with tarfile.open(path) as tar:
        data = {m.name: tar.extractfile(m).read() for m in tar}
    return json.loads(data.pop("manifest.json")), data


def write_tar(path: Path, manifest: dict, members: dict[str, bytes], extra=()) -> Path:
    """A bundle file from parts; `extra`: TarInfo objects (links, devices) added after the members."""
    with gzip.open(path, "wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in [("manifest.json", json.dumps(manifest).encode()), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


def rehash(manifest: dict, members: dict[str, bytes]) -> dict:
    manifest["members"] = {n: {"size": len(d), "sha256": bundle.sha256(d)} for n, d in members.items()}
    return manifest


@pytest.fixture
def exported(tmp_path, monkeypatch):
    """Three selections in cache A, exported to a bundle; the current cache is then an empty B."""
    use_cache(monkeypatch, tmp_path / "a")
    for m in (24, 32, 48):
        store(cpu_problem(m=m))
    path = tmp_path / "bundle.tar.gz"
    report = bundle.export_bundle(path)
    assert report.selections == 3 and report.artifacts == 0 and path.stat().st_size == report.size
    source = stored()
    use_cache(monkeypatch, tmp_path / "b")
    return path, source


def test_export_then_import_gives_the_same_selections_with_a_manifest_of_hashes(exported):
    path, source = exported
    manifest, members = read_tar(path)
    assert manifest["format"] == "kernels-bundle" and manifest["version"] == 1
    assert set(manifest["members"]) == set(members) and len(members) == 3
    assert all(manifest["members"][n] == {"size": len(d), "sha256": bundle.sha256(d)} for n, d in members.items())
    env, = manifest["environments"]
    software = environment.software()
    assert env["gpu"] == "cpu" and env["arch"] == 0 and env["torch"] == software["torch"]
    assert env["triton"] == software["triton"] and env["templates"] == software["templates"]
    assert env["kernels"] == software["kernels"]
    report = bundle.import_bundle(path)
    assert len(report.imported) == 3 and not report.skipped and not report.kept
    assert stored() == source
    again = bundle.import_bundle(path)                  # the same created: kept, not rewritten
    assert again.imported == [] and len(again.kept) == 3


def test_list_and_show_take_a_unique_key_prefix(tmp_path, monkeypatch, capsys):
    use_cache(monkeypatch, tmp_path / "c")
    key = store(cpu_problem(m=24))
    store(cpu_problem(m=32))
    assert main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("-> aten_mm" in line and "burst" in line for line in lines)
    assert any("mm 24x16x40 fp16" in line for line in lines)
    key_id = SelectionStore().path(key).stem
    assert main(["cache", "show", key_id[:6]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("AUTOTUNE mm 24x16x40 fp16") and key_id in out and "torch " in out
    assert main(["cache", "show", "zz"]) == 1
    assert "no stored selection has a key starting with 'zz'" in capsys.readouterr().err
    assert main(["cache", "show", ""]) == 1


def test_a_bundle_for_another_environment_is_refused_naming_the_part(tmp_path, monkeypatch, capsys):
    use_cache(monkeypatch, tmp_path / "a")
    store(cpu_problem(m=24), env={"torch": "9.9.9"})
    gpu = dataclasses.replace(problem(m=64, n=64, k=64, dtype="fp16", arch=90), device_name="NVIDIA H100")
    store(gpu)
    path = tmp_path / "other.tar.gz"
    bundle.export_bundle(path)
    use_cache(monkeypatch, tmp_path / "b")
    with pytest.raises(BundleError) as err:
        bundle.import_bundle(path, machine=here_without_gpu())
    text = str(err.value)
    assert f"torch: bundle 9.9.9, here {environment.software()['torch']} (1 of 2 selections)" in text
    assert "GPU: bundle NVIDIA H100 (sm90), here no GPU (1 of 2 selections)" in text
    assert "Nothing imported" in text and "--partial" not in text and stored() == {}
    with pytest.raises(BundleError, match="is for another environment"):          # --partial: none matches
        bundle.import_bundle(path, partial=True, machine=here_without_gpu())
    h100 = dataclasses.replace(here_without_gpu(), gpus=(("NVIDIA H100", 80),))
    with pytest.raises(BundleError, match="compute capability: bundle sm90, here sm80"):
        bundle.import_bundle(path, machine=h100)
    assert main(["cache", "import", str(path)]) == 1          # the CLI: this machine, no GPU here
    assert "is for another environment: torch: bundle 9.9.9" in capsys.readouterr().err
    assert stored() == {}


def test_partial_imports_the_entries_for_this_environment(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "a")
    mine = store(cpu_problem(m=24))
    store(cpu_problem(m=32), env={"triton": "0.0.1"})
    path = tmp_path / "mixed.tar.gz"
    bundle.export_bundle(path)
    use_cache(monkeypatch, tmp_path / "b")
    with pytest.raises(BundleError, match=r"Triton: bundle 0.0.1.*`--partial` imports the 1 that match"):
        bundle.import_bundle(path)
    report = bundle.import_bundle(path, partial=True)
    assert len(report.imported) == 1 and len(report.skipped) == 1 and "Triton: bundle 0.0.1" in report.skipped[0][1]
    assert list(stored()) == [SelectionStore().path(mine).stem]


def test_a_newer_local_entry_is_kept_and_an_older_one_replaced(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "a")
    now = time.time()
    store(cpu_problem(m=24), created=now - 100)
    store(cpu_problem(m=32), created=now - 100)
    path = tmp_path / "b.tar.gz"
    bundle.export_bundle(path)
    use_cache(monkeypatch, tmp_path / "b")
    newer = store(cpu_problem(m=24), created=now, winner="aten_mm")
    older = store(cpu_problem(m=32), created=now - 200)
    report = bundle.import_bundle(path)
    assert report.kept == [cpu_problem(m=24).short()] and report.imported == [cpu_problem(m=32).short()]
    entries = stored()
    assert entries[SelectionStore().path(newer).stem][1] == now
    assert entries[SelectionStore().path(older).stem][1] == now - 100


def test_a_changed_selection_is_refused_by_its_hash_or_by_the_schema(exported, tmp_path):
    path, _ = exported
    manifest, members = read_tar(path)
    name = min(members)
    data = json.loads(members[name])
    data["selection"]["timings"]["aten_mm"] = 0.0001
    members[name] = json.dumps(data).encode()
    write_tar(path, manifest, members)
    with pytest.raises(BundleError, match=f"member '{name}' .*the manifest says"):
        bundle.import_bundle(path)
    members[name] = members[name].replace(b"0.0001", b"0.0002")          # same size, other bytes
    manifest["members"][name]["size"] = len(members[name])
    write_tar(path, manifest, members)
    with pytest.raises(BundleError, match=f"member '{name}' does not match its sha256"):
        bundle.import_bundle(path)
    data["selection"]["choices"]["aten_mm"]["template"] = "__import__('os').system"    # consistent hashes
    members[name] = json.dumps(data).encode()
    write_tar(path, rehash(manifest, members), members)
    with pytest.raises(BundleError, match="is refused: choice 'aten_mm': unknown template"):
        bundle.import_bundle(path)
    assert stored() == {}


def _info(name: str, kind: bytes, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("name, kind, message", [
    ("../evil.json", None, "is not a name a cache holds"),
    ("/tmp/evil.json", None, "is not a name a cache holds"),
    ("selections/../../evil.json", None, "is not a name a cache holds"),
    ("triton/triton_cache/g/..", None, "is not a name a cache holds"),
    ("cutlass/sm90/x/kernel.so", None, "is not a name a cache holds"),
    ("selections/" + "a" * 32 + ".json", tarfile.SYMTYPE, "is a link, not a plain file"),
    ("selections/" + "b" * 32 + ".json", tarfile.LNKTYPE, "is a link, not a plain file"),
    ("cutlass/sm90/" + "c" * 32 + "/kernel.so", tarfile.CHRTYPE, "is a device or fifo"),
    ("triton/triton_cache/g", tarfile.DIRTYPE, "is a directory"),
])
def test_members_outside_the_cache_links_and_devices_are_refused(exported, tmp_path, name, kind, message):
    path, _ = exported
    manifest, members = read_tar(path)
    if kind is None:
        members_plus = dict(members, **{name: b"{}"})
        write_tar(path, manifest, members_plus)                         # a member the manifest does not list
        with pytest.raises(BundleError, match=f"member '{re.escape(name)}' {message}"):
            bundle.import_bundle(path)
        write_tar(path, rehash(manifest, members_plus), members_plus)   # and one it lists
        message = f"the manifest lists member '{re.escape(name)}', which {message}"
    else:
        write_tar(path, manifest, members, extra=[_info(name, kind, "/etc/passwd")])
    with pytest.raises(BundleError, match=message):
        bundle.import_bundle(path)
    assert stored() == {} and not (tmp_path / "evil.json").exists()


def test_truncated_bundles_and_wrong_manifests_are_clear_errors(exported, tmp_path):
    path, _ = exported
    whole = path.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(BundleError, match="is truncated or not a kernels bundle"):
        bundle.import_bundle(cut)
    cut.write_text("not a bundle")
    with pytest.raises(BundleError, match="is not a gzip file, so not a kernels bundle"):
        bundle.import_bundle(cut)
    with pytest.raises(BundleError, match="no such file"):
        bundle.import_bundle(tmp_path / "absent.tar.gz")
    manifest, members = read_tar(path)
    name = min(members)
    write_tar(cut, manifest, {n: d for n, d in members.items() if n != name})
    with pytest.raises(BundleError, match=f"is truncated: 1 members the manifest lists are missing .first {name}"):
        bundle.import_bundle(cut)
    for change, message in [({"version": 2}, "bundle format version 2; this kernels reads version 1"),
                            ({"format": "zip"}, "not a kernels bundle .manifest format 'zip'"),
                            ({"members": []}, "member list is malformed .wrong schema."),
                            ({"entries": [{"member": name}]}, "a manifest entry is malformed"),
                            ({"environments": [{"gpu": 1}]}, "environments are malformed")]:
        write_tar(cut, dict(manifest, **change), members)
        with pytest.raises(BundleError, match=message):
            bundle.import_bundle(cut)
    write_tar(cut, manifest, {})
    with tarfile.open(cut) as tar:
        assert tar.getnames() == ["manifest.json"]
    with gzip.open(cut, "wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(members[name])
        tar.addfile(info, io.BytesIO(members[name]))
    with pytest.raises(BundleError, match="the first member is .* not manifest.json"):
        bundle.import_bundle(cut)
    assert stored() == {}


def test_a_bundle_that_would_inflate_past_what_one_holds_is_refused_before_it_is_read(exported, tmp_path,
                                                                                      monkeypatch):
    """tarfile reads a pax or GNU long-name header whole before any member limit applies, and gzip inflates what a
    header declares: a 765 KB file took 2.6 GB (an attacker's probe). Both are capped while reading; a bundle that is
    not gzip (as export writes it) is not a bundle."""
    path, _ = exported
    manifest, members = read_tar(path)
    bomb = tmp_path / "bomb.tar.gz"
    with gzip.open(bomb, "wb") as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("manifest.json")
        info.pax_headers = {"comment": "x" * (bundle.MAX_HEADER_BYTES + 1)}
        tar.addfile(info, io.BytesIO(b""))
    assert bomb.stat().st_size < 4096
    with pytest.raises(BundleError, match="not a kernels bundle: a tar extended header of .* bytes"):
        bundle.import_bundle(bomb)
    cap = bundle.MAX_READ_BYTES
    monkeypatch.setattr(bundle, "MAX_READ_BYTES", 2048)      # a whole bundle is more than this
    with pytest.raises(BundleError, match="not a kernels bundle: it inflates past 2048 bytes"):
        bundle.import_bundle(path)
    monkeypatch.setattr(bundle, "MAX_READ_BYTES", cap)
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:
        for name, data in [("manifest.json", json.dumps(manifest).encode()), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="is not a gzip file, so not a kernels bundle"):
        bundle.import_bundle(plain)
    # a GNU sparse member reads its map block by block into memory, ~11x what it inflates to (a reviewer's 458 KB
    # file took 1.5 GB): refused before the map is read
    sparse = tmp_path / "sparse.tar.gz"
    header = bytearray(tarfile.TarInfo("manifest.json").tobuf(format=tarfile.GNU_FORMAT)[:512])
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[482] = 1                                     # "an extension block follows"
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    with gzip.open(sparse, "wb") as gz:
        gz.write(bytes(header) + (b"\0" * 504 + b"\x01" + b"\0" * 7) * 64 + b"\0" * 1024)
    with pytest.raises(BundleError, match="not a kernels bundle: a sparse member"):
        bundle.import_bundle(sparse)
    assert stored() == {}


def test_a_deeply_nested_manifest_and_oversized_members_are_clear_errors(exported, tmp_path, monkeypatch):
    """Read into memory before anything is checked: a manifest nested past the parser's recursion and members over
    the size limits are refused as BundleErrors, not tracebacks or gigabytes read."""
    path, _ = exported
    manifest, members = read_tar(path)
    cut = tmp_path / "cut.tar.gz"
    with gzip.open(cut, "wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        deep = b"[" * 100000 + b"]" * 100000
        info = tarfile.TarInfo("manifest.json")
        info.size = len(deep)
        tar.addfile(info, io.BytesIO(deep))
    with pytest.raises(BundleError, match="the manifest is not JSON .RecursionError"):
        bundle.import_bundle(cut)
    biggest = max(len(d) for d in members.values())
    monkeypatch.setattr(bundle, "MAX_MEMBER_BYTES", biggest - 1)
    write_tar(cut, manifest, members)
    with pytest.raises(BundleError, match="over its limits"):
        bundle.import_bundle(cut)
    monkeypatch.setattr(bundle, "MAX_MEMBER_BYTES", biggest)
    monkeypatch.setattr(bundle, "MAX_TOTAL_BYTES", sum(len(d) for d in members.values()) - 1)
    with pytest.raises(BundleError, match="over its limits"):
        bundle.import_bundle(cut)
    assert stored() == {}
    # export keeps to the same limits: it never writes a bundle its own import would refuse
    use_cache(monkeypatch, tmp_path / "a")
    with pytest.raises(BundleError, match="would break the limits import takes"):
        bundle.export_bundle(tmp_path / "too_big.tar.gz")
    assert not (tmp_path / "too_big.tar.gz").exists()


def test_export_replaces_a_link_at_the_destination_and_never_writes_through_it(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "a")
    store(cpu_problem())
    target = tmp_path / "target"
    target.write_text("keep me")
    link = tmp_path / "out.tar.gz"
    link.symlink_to(target)
    bundle.export_bundle(link)
    assert target.read_text() == "keep me" and not link.is_symlink() and read_tar(link)[1]
    with pytest.raises(BundleError, match="no stored selection matching zz"):
        bundle.export_bundle(tmp_path / "none.tar.gz", ("zz",))
    assert not (tmp_path / "none.tar.gz").exists()


def test_export_problems_selects_by_key_prefix_or_name_pattern(tmp_path, monkeypatch, capsys):
    use_cache(monkeypatch, tmp_path / "a")
    first = SelectionStore().path(store(cpu_problem(m=24))).stem
    store(cpu_problem(m=32))
    store(cpu_problem(m=48, n=8))
    assert bundle.export_bundle(tmp_path / "x.tar.gz", (first[:8],)).selections == 1
    assert bundle.export_bundle(tmp_path / "y.tar.gz", ("mm *x16x40 *",)).selections == 2
    # a name copied from `cache list` whole: its strides' brackets are not a character class there
    shown = cpu_problem(m=48, n=8).short()
    assert "[" in shown and bundle.export_bundle(tmp_path / "v.tar.gz", (shown,)).selections == 1
    listed = tmp_path / "model.csv"
    listed.write_text("m,n,k,dtype,layout\n24,16,40,fp16,nn\n48,8,40,fp16,nn\n7,7,7,fp16,nn\n")
    assert main(["cache", "export", str(tmp_path / "z.tar.gz"), "--problems", str(listed)]) == 0
    assert {e["problem"] for e in read_tar(tmp_path / "z.tar.gz")[0]["entries"]} == {
        cpu_problem(m=24).short(), cpu_problem(m=48, n=8).short()}
    assert "1 of the listed problems have no stored selection here" in capsys.readouterr().err
    listed.write_text("m,n,k,dtype,layout\n24,16,40,fp99,nn\n")
    assert main(["cache", "export", str(tmp_path / "z.tar.gz"), "--problems", str(listed)]) == 1
    # a typo is an error naming it, not a bundle quietly short of it
    with pytest.raises(bundle.BundleError, match="--problems zzz: no stored selection matches"):
        bundle.export_bundle(tmp_path / "w.tar.gz", (first[:8], "zzz"))
    assert not (tmp_path / "w.tar.gz").exists()
    assert main(["cache", "export", str(tmp_path / "w.tar.gz"), "--problems", str(tmp_path / "missing.csv")]) == 1
    assert "missing.csv: no such problem list" in capsys.readouterr().err and not (tmp_path / "w.tar.gz").exists()


# -- CUTLASS binaries travel ---------------------------------------------------------------------------------------
@pytest.fixture
def cutlass_bundle(tmp_path, monkeypatch):
    """A CPU problem whose winner is a (fake-built) CUTLASS kernel, exported from cache A; current cache: empty B."""
    fake = fake_cutlass.make_toolchain(tmp_path / "toolchain")
    backend = fake_cutlass.install(monkeypatch, fake_cutlass.CpuServedCutlass(fake.tools))
    use_cache(monkeypatch, tmp_path / "a")
    p = cpu_problem(m=64, n=64, k=64)
    choice = backend.choices(p)[0][0]
    assert backend.prebuild([(p, [choice])]) == 1
    store(p, winner=choice.name, choices={choice.name: choice, "aten_mm": Choice("aten", "aten_mm", "fp16")})
    path = tmp_path / "cutlass.tar.gz"
    report = bundle.export_bundle(path)
    assert report.artifacts == 2 and not report.missing
    use_cache(monkeypatch, tmp_path / "b")
    return path, p, choice, backend, fake


def test_a_cutlass_winner_travels_with_its_binary_and_loads_without_a_compile(cutlass_bundle):
    path, p, choice, backend, fake = cutlass_bundle
    manifest, members = read_tar(path)
    key, _, _ = backend.artifact_paths(p, choice)
    assert {f"cutlass/sm90/{key}/kernel.so", f"cutlass/sm90/{key}/meta.json"} <= set(members)
    env, = manifest["environments"]
    assert env["nvcc"] == fake_cutlass.NVCC_VERSION and env["cutlass"] == "0.0.0"
    compiled = len(fake.compiles())
    report = bundle.import_bundle(path)
    assert len(report.imported) == 1 and report.artifacts_written == 1
    assert backend.state(p, choice) == "built"
    outcome, = backend.build(p, [choice])
    assert outcome.runner is not None and not outcome.compiled and len(fake.compiles()) == compiled
    assert bundle.import_bundle(path).artifacts_present == 1


def test_a_changed_cutlass_binary_is_refused(cutlass_bundle):
    path, p, choice, backend, _ = cutlass_bundle
    manifest, members = read_tar(path)
    binary = next(n for n in members if n.endswith("kernel.so"))
    members[binary] = members[binary].replace(b"fake", b"evil")
    write_tar(path, manifest, members)
    with pytest.raises(BundleError, match=f"member '{binary}' does not match its sha256"):
        bundle.import_bundle(path)
    write_tar(path, rehash(manifest, members), members)            # the manifest agrees; the marker does not
    with pytest.raises(BundleError, match="does not match its marker"):
        bundle.import_bundle(path)
    assert stored() == {} and backend.state(p, choice) == "missing"


def test_a_cutlass_winner_for_another_nvcc_is_refused_naming_nvcc(cutlass_bundle, monkeypatch):
    path, _, _, _, fake = cutlass_bundle
    other = Toolchain(CutlassDir(fake.cutlass_root, "CUTLASS_DIR", "0.0.0"), fake.nvcc, "12.8.1")
    fake_cutlass.install(monkeypatch, fake_cutlass.CpuServedCutlass(other))
    with pytest.raises(BundleError, match=f"nvcc: bundle {fake_cutlass.NVCC_VERSION}, here 12.8.1"):
        bundle.import_bundle(path)


# -- concurrency, verify, prune, clear ------------------------------------------------------------------------------
def test_two_imports_at_once_leave_a_valid_store(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "a")
    for m in range(1, 25):
        store(cpu_problem(m=m))
    path = tmp_path / "many.tar.gz"
    bundle.export_bundle(path)
    source = stored()
    target = use_cache(monkeypatch, tmp_path / "b")
    env = dict(os.environ, KERNELS_CACHE_DIR=str(target), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-m", "kernels", "cache", "import", str(path)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    imported = [int(out.split("imported ")[1].split()[0]) for out, _ in outputs]
    assert sum(imported) == 24                          # each entry written once, kept by the other import
    assert stored() == source
    report = cache_admin.verify()
    assert report.bad == [] and report.checked["selection"] == 24


def test_verify_reports_bad_entries_and_fix_removes_them(tmp_path, monkeypatch, capsys):
    fake = fake_cutlass.make_toolchain(tmp_path / "toolchain")
    backend = fake_cutlass.install(monkeypatch, fake_cutlass.CpuServedCutlass(fake.tools))
    use_cache(monkeypatch, tmp_path / "c")
    store(cpu_problem(m=24))
    torn = SelectionStore().path(store(cpu_problem(m=32)))
    torn.write_text(torn.read_text()[:40])
    p = cpu_problem(m=64, n=64, k=64)
    choice = backend.choices(p)[0][0]
    backend.prebuild([(p, [choice])])
    _, paths, _ = backend.artifact_paths(p, choice)
    paths.binary.write_text("swapped")
    assert main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert "selection: 2" in out and "CUTLASS binary: 1" in out and "2 bad" in out
    assert f"bad selection: {torn}" in out and f"bad CUTLASS binary: {paths.binary}" in out
    assert main(["cache", "verify", "--fix"]) == 0
    assert "removed 2" in capsys.readouterr().out
    assert not torn.exists() and backend.state(p, choice) == "missing"
    assert main(["cache", "verify"]) == 0


def test_prune_removes_old_and_stale_selections_only(tmp_path, monkeypatch, capsys):
    use_cache(monkeypatch, tmp_path / "c")
    store(cpu_problem(m=24), created=time.time() - 3 * 86400)
    fresh = store(cpu_problem(m=32))
    store(cpu_problem(m=48), env={"kernels": "0.0.0"})
    assert main(["cache", "prune"]) == 1
    assert "--older-than DAYS and/or --stale" in capsys.readouterr().err
    assert main(["cache", "prune", "--older-than", "2"]) == 0
    assert "removed 1 selections, kept 2" in capsys.readouterr().out
    assert cache_admin.prune(stale=True).removed == [cpu_problem(m=48).short()]
    assert list(stored()) == [SelectionStore().path(fresh).stem]
    with pytest.raises(SystemExit):
        main(["cache", "prune", "--older-than", "-1"])


def test_prune_older_than_removes_old_tune_worker_logs_too(tmp_path, monkeypatch, capsys):
    root = use_cache(monkeypatch, tmp_path / "c")
    store(cpu_problem(m=24))
    logs = root / "logs"
    logs.mkdir(mode=0o700)
    old, new = logs / "tune-gpu0-1-1.log", logs / "tune-gpu1-1-2.log"
    for path in (old, new):
        path.write_text("a worker's stderr")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    assert main(["cache", "prune", "--older-than", "2"]) == 0
    assert "1 old tune worker logs" in capsys.readouterr().out
    assert not old.exists() and new.exists()


def test_prune_older_than_removes_what_killed_writers_left_in_the_store(tmp_path, monkeypatch, capsys):
    """A writer killed between its temporary file and the rename leaves `.<name>.<pid>.<hex>.tmp` beside the entry;
    `prune --older-than` removes those as old (a write takes milliseconds), never a fresh one (a write under way),
    an entry, another file or what a link points to."""
    root = use_cache(monkeypatch, tmp_path / "c")
    kept = store(cpu_problem(m=24))
    folder = root / "selections"
    dynamic = folder / "dynamic"
    dynamic.mkdir(mode=0o700, exist_ok=True)
    old_one, old_bucket = folder / ".abc.json.4242.0123abcd.tmp", dynamic / ".d.json.77.89abcdef.tmp"
    fresh, other = folder / ".abc.json.4243.0123abce.tmp", folder / "notes.tmp"
    outside = tmp_path / "outside.tmp"
    for path in (old_one, old_bucket, fresh, other, outside):
        path.write_text("{")
    link = folder / ".lnk.json.1.0123abcd.tmp"
    link.symlink_to(outside)
    for path in (old_one, old_bucket, other, outside):
        os.utime(path, (time.time() - 3 * 86400,) * 2)
    os.utime(link, (time.time() - 3 * 86400,) * 2, follow_symlinks=False)
    assert main(["cache", "prune", "--older-than", "2"]) == 0
    assert "2 temporary files killed writers left" in capsys.readouterr().out
    assert not old_one.exists() and not old_bucket.exists()
    assert fresh.exists() and other.exists() and outside.exists() and link.is_symlink()
    assert list(stored()) == [SelectionStore().path(kept).stem]


def test_clear_asks_for_yes_and_then_empties_the_cache(tmp_path, monkeypatch, capsys):
    root = use_cache(monkeypatch, tmp_path / "c")
    store(cpu_problem())
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["cache", "clear"]) == 1 and stored()
    assert "without --yes" in capsys.readouterr().err
    assert main(["cache", "clear", "--yes"]) == 0
    assert [p.name for p in root.iterdir()] == ["CACHEDIR.TAG"] and root.is_dir()


def test_clear_removes_only_what_kernels_made(tmp_path, monkeypatch, capsys):
    """A cache kernels created (tagged) is cleared of its own entries only; something else put there stays."""
    root = use_cache(monkeypatch, tmp_path / "c")
    store(cpu_problem())
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    (root / "notes.md").write_text("mine")
    assert main(["cache", "clear", "--yes"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["CACHEDIR.TAG", "notes.md"] and not stored()


def test_clear_refuses_a_folder_kernels_did_not_create(tmp_path, monkeypatch, capsys):
    """KERNELS_CACHE_DIR naming an existing folder by mistake (a source tree with its own cutlass and triton
    checkouts): clear removes nothing there, names what it found, and says why."""
    src = tmp_path / "src"
    for name in ("cutlass", "triton", "thesis"):
        (src / name).mkdir(parents=True)
        (src / name / "README").write_text("years of work")
    src.chmod(0o700)
    use_cache(monkeypatch, src)
    assert main(["cache", "clear", "--yes"]) == 1
    err = capsys.readouterr().err
    assert "was not created by kernels (no CACHEDIR.TAG) and holds 1 other entries (thesis): nothing removed" in err
    assert all((src / name / "README").read_text() == "years of work" for name in ("cutlass", "triton", "thesis"))
    # an untagged folder holding nothing but the cache's own entries (a cache made before the tag) is cleared
    shutil.rmtree(src / "thesis")
    assert main(["cache", "clear", "--yes"]) == 0 and list(src.iterdir()) == []


def test_a_cache_directory_that_fails_its_checks_is_refused_before_anything_is_written(exported, tmp_path,
                                                                                         monkeypatch):
    path, _ = exported
    shared = use_cache(monkeypatch, tmp_path / "shared")
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    with pytest.warns(CacheWarning, match="writable by group or others"), \
            pytest.raises(cache_admin.CacheAdminError, match="is writable by group or others .mode 777.; nothing"):
        bundle.import_bundle(path)
    assert list(shared.iterdir()) == []


# -- Triton kernels travel (files made up here; tests/interp/test_bundle_processes.py compiles real ones) -----------
@pytest.fixture
def triton_bundle(tmp_path, monkeypatch):
    """A GPU problem whose winner's Triton kernel has a build record and cache folder in cache A (as a compile on
    that GPU leaves them), exported; the current cache is an empty B."""
    use_cache(monkeypatch, tmp_path / "a")
    p = problem(m=64, n=64, k=64, dtype="fp16")
    choice = Choice("triton", "triton_mm", "fp16", GemmConfig(32, 32, 32, 2, 4))
    need, = winner_artifacts.needs(p, choice)
    folder = winner_artifacts.triton_folder("W5ABGQLDRFKYOY6F")
    folder.mkdir(parents=True)
    files = {f"{need.kernel}.cubin": b"\x7fELF cubin", f"{need.kernel}.json": b'{"name": "k"}'}
    files[f"__grp__{need.kernel}.json"] = json.dumps({"child_paths": {n: str(folder / n) for n in files}}).encode()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"kernel": need.kernel, "triton": triton_version(), "arch": 90, "triton_hash": "ab" * 32,
              "cache_group": folder.name, "compile_seconds": 0.5,
              "files": {n: bundle.sha256(d) for n, d in files.items()}}
    winner_artifacts.triton_record(need.key).parent.mkdir(parents=True)
    winner_artifacts.triton_record(need.key).write_text(json.dumps(record))
    store(p, winner=choice.name, choices={choice.name: choice})
    path = tmp_path / "triton.tar.gz"
    assert bundle.export_bundle(path).artifacts == 4
    fresh = use_cache(monkeypatch, tmp_path / "b")
    return path, need, files, fresh


def test_a_triton_winner_travels_with_its_cache_folder_and_triton_index_rewritten_for_this_cache(triton_bundle):
    path, need, files, fresh = triton_bundle
    machine = dataclasses.replace(here_without_gpu(), gpus=(("test", 90),))
    report = bundle.import_bundle(path, machine=machine)
    assert len(report.imported) == 1 and report.artifacts_written == 1
    folder = fresh / "triton" / "triton_cache" / "W5ABGQLDRFKYOY6F"
    index = json.loads((folder / f"__grp__{need.kernel}.json").read_text())["child_paths"]
    assert index == {n: str(folder / n) for n in files if not n.startswith("__grp__")}
    assert all((folder / n).read_bytes() == d for n, d in files.items() if not n.startswith("__grp__"))
    assert cache_admin.verify().bad == []               # the record's hashes match the files as written here
    assert bundle.import_bundle(path, machine=machine).artifacts_present == 1


def test_a_changed_triton_file_or_an_index_naming_other_files_is_refused(triton_bundle):
    path, need, _, fresh = triton_bundle
    machine = dataclasses.replace(here_without_gpu(), gpus=(("test", 90),))
    manifest, members = read_tar(path)
    cubin = next(n for n in members if n.endswith(".cubin"))
    changed = dict(members, **{cubin: b"\x7fELF evil!"})
    write_tar(path, rehash(manifest, changed), changed)         # the manifest agrees; the build record does not
    with pytest.raises(BundleError, match=f"{need.kernel}: .*cubin does not match its build record"):
        bundle.import_bundle(path, machine=machine)
    index = next(n for n in members if "__grp__" in n)
    escaped = dict(members, **{index: json.dumps({"child_paths": {"../../../evil": "/etc/passwd"}}).encode()})
    record_name = next(n for n in members if n.startswith("triton/artifacts/"))
    record = json.loads(members[record_name])
    record["files"][index.rsplit("/", 1)[1]] = bundle.sha256(escaped[index])
    escaped[record_name] = json.dumps(record).encode()
    write_tar(path, rehash(manifest, escaped), escaped)
    with pytest.raises(BundleError, match="its cache index names files the record does not list"):
        bundle.import_bundle(path, machine=machine)
    assert stored() == {} and not (fresh / "triton").exists()


@pytest.mark.parametrize("planted", ["__triton_launcher.so", "{kernel}.so", "other_kernel.cubin"])
def test_a_triton_record_naming_files_not_its_kernels_is_refused(triton_bundle, planted):
    """A bundle's build record may list only its own kernel's files, as Triton names them: not Triton's launcher
    library (which Triton loads, unchecked, from folders of the same cache: one planted there would run under every
    later kernel), nor another kernel's (an attacker's probe)."""
    path, need, _, fresh = triton_bundle
    machine = dataclasses.replace(here_without_gpu(), gpus=(("test", 90),))
    manifest, members = read_tar(path)
    record_name = next(n for n in members if n.startswith("triton/artifacts/"))
    record = json.loads(members[record_name])
    cubin = next(n for n in members if n.endswith(".cubin"))
    name = planted.format(kernel=need.kernel)
    planted_member = cubin.rsplit("/", 1)[0] + "/" + name
    changed = dict(members, **{planted_member: b"\x7fELF planted"})
    record["files"][name] = bundle.sha256(changed[planted_member])
    changed[record_name] = json.dumps(record).encode()
    write_tar(path, rehash(manifest, changed), changed)
    with pytest.raises(BundleError, match="names files that are not its kernel's"):
        bundle.import_bundle(path, machine=machine)
    assert stored() == {} and not (fresh / "triton").exists()


def test_clear_and_kernels_own_agree_on_a_tag_that_is_not_a_regular_file(tmp_path, monkeypatch, capsys):
    """A CACHEDIR.TAG that is a link or a folder is not kernels' tag: the folder is not kernels' own to clear."""
    from kernels.core.cache_root import kernels_own

    src = tmp_path / "src"
    (src / "triton").mkdir(parents=True)
    (src / "triton" / "README").write_text("years of work")
    (src / "CACHEDIR.TAG").symlink_to(tmp_path / "elsewhere")
    src.chmod(0o700)
    use_cache(monkeypatch, src)
    assert not kernels_own(src)
    assert main(["cache", "clear", "--yes"]) == 1
    assert "holds 1 other entries (CACHEDIR.TAG): nothing removed" in capsys.readouterr().err
    assert (src / "triton" / "README").read_text() == "years of work"
