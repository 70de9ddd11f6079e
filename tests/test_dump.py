import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from modeltap.capture import capture
from modeltap.dump import DumpWriter, load_dump
from modeltap.errors import DumpFormatError, InputError
from modeltap.loading import Inputs
from modeltap.run import dump_model
from tests.fixtures.models import InPlace, ReuseLinear, Wrapped


def _inputs(*args, **kwargs):
    return Inputs(args, kwargs, {"test": True})


def test_written_tensors_equal_an_independent_capture(tmp_path):
    torch.manual_seed(0)
    m = InPlace().eval()
    x = torch.randn(3, 4)
    path = dump_model(m, _inputs(x), tmp_path / "d.safetensors")
    on_disk = load_file(path)  # safetensors' own reader, not ours
    with torch.no_grad():
        a = m.a(x)
        b = m.b(a + 1.0)
    assert torch.equal(on_disk["a"], a)
    assert torch.equal(on_disk["b"], b)
    assert torch.equal(on_disk["act"], torch.relu(b))


def test_aliases_stored_once_and_resolved_by_reader(tmp_path):
    m = Wrapped().eval()
    x = torch.randn(2, 4)
    path = dump_model(m, _inputs(x), tmp_path / "d.safetensors")
    assert set(load_file(path)) == {"inner.0"}
    dump = load_dump(path)
    assert dump.aliases == {"inner.1": "inner.0", "inner": "inner.0", "__root__": "inner.0"}
    expected = m.inner[0](x).detach()
    for key in ("inner.0", "inner.1", "inner", "__root__"):
        assert torch.allclose(dump[key], expected)
    assert dump.order == ["inner.0", "inner.1", "inner", "__root__"]
    assert dump.stats_for("inner").norm == pytest.approx(float(expected.double().norm()), rel=1e-6)


def test_same_run_gives_byte_identical_files(tmp_path):
    m = ReuseLinear().eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    a = dump_model(m, _inputs(x), tmp_path / "a.safetensors")
    b = dump_model(m, _inputs(x), tmp_path / "b.safetensors")
    assert a.read_bytes() == b.read_bytes()


def test_header_outgrowing_its_reservation_is_moved(tmp_path):
    tensors = {f"t{i}": torch.full((3, 5), float(i)) for i in range(40)}
    with DumpWriter(tmp_path / "d.safetensors", reserve=8) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value)
        path = writer.finish({"model": "x"})
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".*tmp*"))


def test_header_is_padded_and_aligned(tmp_path):
    with DumpWriter(tmp_path / "d.safetensors") as writer:
        writer.tensor("x", torch.arange(6, dtype=torch.int64).reshape(2, 3))
        path = writer.finish({})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["x"] == {"dtype": "I64", "shape": [2, 3], "data_offsets": [0, 48]}
    assert header["__metadata__"]["format"] == "modeltap"


def test_bfloat16_round_trip(tmp_path):
    x = torch.randn(4, 4).to(torch.bfloat16)
    with DumpWriter(tmp_path / "d.safetensors") as writer:
        writer.tensor("x", x)
        path = writer.finish({})
    assert torch.equal(load_file(path)["x"], x)


def test_error_midway_leaves_no_file(tmp_path):
    target = tmp_path / "d.safetensors"
    with pytest.raises(RuntimeError):
        with DumpWriter(target) as writer:
            writer.tensor("x", torch.ones(3))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_failed_forward_leaves_no_file(tmp_path):
    from modeltap.errors import RunError

    with pytest.raises(RunError, match="Wrapped.forward failed"):
        dump_model(Wrapped(), _inputs(torch.randn(2, 7)), tmp_path / "d.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_stats_only_writes_no_tensor(tmp_path):
    path = dump_model(
        Wrapped().eval(), _inputs(torch.randn(2, 4)), tmp_path / "d.safetensors", stats_only=True
    )
    dump = load_dump(path)
    assert dump.stored == [] and set(dump.stats) == {"inner.0"}
    assert dump.metadata["stats_only"] == "true"


def test_memory_capture_and_dump_agree_on_keys(tmp_path):
    m = ReuseLinear().eval()
    x = torch.randn(2, 4)
    cap = capture(m, x)
    dump = load_dump(dump_model(m, _inputs(x), tmp_path / "d.safetensors"))
    assert dump.keys() == cap.keys()
    assert dump.aliases == cap.aliases


def test_unwritable_destinations(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        DumpWriter(tmp_path / "file" / "d.safetensors")
    with pytest.raises(InputError, match="is a directory"):
        DumpWriter(tmp_path)


def test_reader_rejects_garbage_and_truncation(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(DumpFormatError, match="not a readable safetensors file"):
        load_dump(junk)
    good = dump_model(Wrapped().eval(), _inputs(torch.randn(2, 4)), tmp_path / "d.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-7])
    with pytest.raises(DumpFormatError):
        load_dump(cut)


def test_newer_format_version_is_refused(tmp_path):
    with DumpWriter(tmp_path / "d.safetensors") as writer:
        writer.tensor("x", torch.ones(2))
        path = writer.finish({})
    raw = path.read_bytes().replace(b'"format_version":"1"', b'"format_version":"9"')
    path.write_bytes(raw)
    with pytest.raises(DumpFormatError, match="upgrade modeltap"):
        load_dump(path)


def test_reader_views_are_private_and_misaligned_tensors_still_read(tmp_path):
    odd = torch.arange(3, dtype=torch.bfloat16)  # 6 bytes: the next tensor starts misaligned
    wide = torch.arange(4, dtype=torch.float32)
    with DumpWriter(tmp_path / "d.safetensors") as writer:
        writer.tensor("odd", odd)
        writer.tensor("wide", wide)
        path = writer.finish({})
    before = path.read_bytes()
    dump = load_dump(path)
    assert torch.equal(dump["odd"], odd) and torch.equal(dump["wide"], wide)
    dump["odd"].add_(1)  # a copy-on-write page: the file is untouched
    assert path.read_bytes() == before
    assert torch.equal(load_dump(path)["odd"], odd)


def test_missing_output_folders_are_created(tmp_path):
    path = tmp_path / "runs" / "exp" / "d.safetensors"
    with DumpWriter(path) as writer:
        writer.tensor("x", torch.ones(2))
        writer.finish({})
    assert load_dump(path)["x"].tolist() == [1.0, 1.0]


def test_symlinked_output_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "store" / "real.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    with DumpWriter(link) as writer:
        writer.tensor("x", torch.arange(3.0))
        writer.finish({})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_dump(target)["x"].tolist() == [0.0, 1.0, 2.0]
    assert not list(tmp_path.glob(".*tmp")) and not list(target.parent.glob(".*tmp"))


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f".old.safetensors.{dead.stdout.strip()}.tmp"
    stale.write_bytes(b"\0" * 64)
    live = tmp_path / f".other.safetensors.{os.getppid()}.tmp"  # a live process's: kept
    live.write_bytes(b"\0")
    unrelated = tmp_path / ".notes.99999999.tmp"  # not our naming: kept
    unrelated.write_bytes(b"\0")
    with DumpWriter(tmp_path / "new.safetensors") as writer:
        writer.finish({})
    assert not stale.exists() and live.exists() and unrelated.exists()
