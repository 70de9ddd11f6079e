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
from modeltap.dumping import dump_model
from modeltap.errors import DumpFormatError, InputError
from modeltap.loading import Inputs
from modeltap.stats import tensor_stats
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


def _header_sizes(path):
    """(header bytes as the file declares them, of which JSON: the rest is padding)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, len(raw[8 : 8 + n].rstrip(b" "))


def test_oversized_reservation_leaves_no_padding_beyond_the_headers_size(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(4, 8) for i in range(30)}
    metadata = {"model": "x" * 50_000}
    with DumpWriter(tmp_path / "d.safetensors", reserve=16 << 20) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value)
        path = writer.finish(metadata)
    n, json_bytes = _header_sizes(path)
    assert n <= 2 * json_bytes, (n, json_bytes)  # was the whole 16 MiB reservation
    assert path.stat().st_size < 1 << 20
    with safe_open(str(path), "pt") as f:  # safetensors' own reader
        assert f.metadata()["model"] == metadata["model"]
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
    dump = load_dump(path)
    assert all(torch.equal(dump[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("reserve", [8, 1 << 20])
def test_a_small_header_moved_lands_before_its_data(tmp_path, reserve):
    # a header smaller than the file object's buffer, behind which the data is copied
    tensors = {"a": torch.arange(5.0), "b": torch.ones(2, 3, dtype=torch.int64)}
    with DumpWriter(tmp_path / "d.safetensors", reserve=reserve) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value)
        path = writer.finish({})
    n, json_bytes = _header_sizes(path)
    assert n < 1024 and n - json_bytes < 8
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_data_much_larger_than_the_padding_stays_where_it_is(tmp_path):
    # moving 16 MiB of data to give back 1 MiB of padding costs more than it saves
    big = torch.arange(4 << 20, dtype=torch.float32)
    with DumpWriter(tmp_path / "d.safetensors", reserve=1 << 20) as writer:
        writer.tensor("big", big)
        path = writer.finish({})
    n, _ = _header_sizes(path)
    assert n == 1 << 20
    assert torch.equal(load_file(path)["big"], big)


def test_generate_header_grows_with_its_metadata_not_its_reservation(tmp_path):
    from safetensors import safe_open
    from transformers import T5Config, T5ForConditionalGeneration

    from modeltap.generate import generate_model
    from modeltap.generate.options import Decoding

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=512, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None  # every one of the steps asked for
    ids = torch.randint(2, 512, (1, 8))
    inputs = _inputs(input_ids=ids, attention_mask=torch.ones_like(ids))
    steps = 40
    path = tmp_path / "g.safetensors"
    generate_model(model, inputs, path, decoding=Decoding(max_new_tokens=steps))
    n, json_bytes = _header_sizes(path)
    # the reservation counted every module (the encoder's too) in each step, at 1536 bytes:
    # 6.5 MB of header for 0.84 MB of JSON
    assert n <= 2 * json_bytes, (n, json_bytes)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
    assert len(json.loads(meta["generate"])["new_ids"][0]) == steps
    with torch.no_grad():
        encoded = model.encoder(input_ids=ids, attention_mask=torch.ones_like(ids))
    # the encoder's output is stored as its last layer norm's (an alias)
    encoded = encoded.last_hidden_state
    torch.testing.assert_close(stored["gen/step0/encoder.final_layer_norm"], encoded)
    dump = load_dump(path)
    assert set(dump.stored) == set(stored)
    torch.testing.assert_close(dump["gen/step0/encoder:last_hidden_state"], encoded)
    assert any(k.startswith(f"gen/step{steps - 1}/decoder") for k in dump.stats)


def test_seeded_dump_draws_what_a_seeded_forward_draws_without_torch_manual_seed(
    tmp_path, monkeypatch
):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5))
    x = torch.randn(3, 4)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = model.train()(x)  # the reference: torch's own seeding, dropout on
    model.eval()

    def refuse(seed):
        raise AssertionError("torch.manual_seed formats the stack for each idle device runtime")

    # (1.1 ms of a small dump's CPU in a new process)
    monkeypatch.setattr(torch, "manual_seed", refuse)
    path = dump_model(model, _inputs(x), tmp_path / "d.safetensors", train_mode=True, seed=7)
    assert torch.equal(load_file(path)["1"], expected)
    assert not model.training


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


# ---- the writer thread (issue #12) --------------------------------------------------------


def _mixed_tensors():
    g = torch.Generator().manual_seed(5)
    return {
        "contiguous": torch.randn(6, 7, 16, generator=g),
        "permuted": torch.randn(4, 6, 3, 8, generator=g).permute(0, 2, 1, 3),
        "transposed": torch.randn(40, 24, generator=g).t(),
        "strided": torch.randn(10, 30, generator=g)[:, ::3],
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "ints": torch.arange(24, dtype=torch.int64).reshape(4, 6),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def _write_all(path, tensors, *, mutate, **kwargs):
    with DumpWriter(path, **kwargs) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value, count_zeros=True)
            if mutate and value.numel():
                value.add_(1)  # the model changes it in place right after its module returned
        writer.finish({"model": "x"})
    return writer


@pytest.mark.parametrize("cap", [0, 64, 1000, 1 << 20])
def test_threaded_writes_equal_inline_and_keep_values_as_they_were(tmp_path, monkeypatch, cap):
    import modeltap.dump.writer as dump_module

    expected = {k: v.clone() for k, v in _mixed_tensors().items()}
    inline = _write_all(
        tmp_path / "inline.safetensors", _mixed_tensors(), mutate=True, max_inflight=0
    )
    monkeypatch.setattr(dump_module, "_THREAD_MIN_BYTES", 0)  # every tensor through the thread
    threaded = _write_all(
        tmp_path / "t.safetensors", _mixed_tensors(), mutate=True, max_inflight=cap
    )
    on_disk = load_file(tmp_path / "t.safetensors")  # safetensors' own reader
    for key, value in expected.items():
        assert torch.equal(on_disk[key], value.contiguous()), key
        if value.numel() and value.is_floating_point():
            ref = value.double()
            assert threaded.stats[key].norm == pytest.approx(float(ref.norm()), rel=1e-6)
            assert threaded.stats[key].max == float(ref.max())
    # Same bytes and statistics whichever thread computed them, down to the last bit.
    assert (tmp_path / "t.safetensors").read_bytes() == (
        tmp_path / "inline.safetensors"
    ).read_bytes()
    assert threaded.peak_inflight <= cap and inline.peak_inflight == 0


def test_back_pressure_holds_the_cap_with_a_slow_file(tmp_path, monkeypatch):
    import time

    import modeltap.dump.writer as dump_module
    from modeltap.dump import pipeline

    monkeypatch.setattr(dump_module, "_THREAD_MIN_BYTES", 0)
    real_write = pipeline.write_at
    writes = []

    def slow_write(fd, tensor, position):
        time.sleep(0.01)  # a disk much slower than the model
        writes.append(position)
        real_write(fd, tensor, position)

    monkeypatch.setattr(pipeline, "write_at", slow_write)
    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(30)}  # 256 bytes each
    cap = 3 * 256
    with DumpWriter(tmp_path / "d.safetensors", max_inflight=cap) as writer:
        start = time.perf_counter()
        for key, value in tensors.items():
            writer.tensor(key, value)
        queued = time.perf_counter() - start
        path = writer.finish({})
    # The caller had to wait for the file (30 writes of 10 ms, at most 3 ahead) ...
    assert queued > 0.2
    # ... and never held more than the cap.
    assert 0 < writer.peak_inflight <= cap
    assert len(writes) == 30
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_writer_thread_failure_reaches_the_caller_and_leaves_no_file(tmp_path, monkeypatch):
    import modeltap.dump.writer as dump_module
    from modeltap.dump import pipeline

    monkeypatch.setattr(dump_module, "_THREAD_MIN_BYTES", 0)

    def failing_write(fd, tensor, position):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "write_at", failing_write)
    with pytest.raises(OSError, match="No space left"):
        with DumpWriter(tmp_path / "d.safetensors", max_inflight=1 << 16) as writer:
            for i in range(20):
                writer.tensor(f"t{i}", torch.ones(100))
            writer.finish({})
    assert list(tmp_path.iterdir()) == []


def test_dump_of_an_in_place_model_is_the_same_through_the_thread(tmp_path, monkeypatch):
    import modeltap.dump.writer as dump_module

    torch.manual_seed(0)
    m = InPlace().eval()
    x = torch.randn(3, 4)
    inline = dump_model(m, _inputs(x), tmp_path / "inline.safetensors", max_inflight=0)
    monkeypatch.setattr(dump_module, "_THREAD_MIN_BYTES", 0)
    threaded = dump_model(m, _inputs(x), tmp_path / "threaded.safetensors", max_inflight=64)
    assert threaded.read_bytes() == inline.read_bytes()
    with torch.no_grad():
        a = m.a(x)
        b = m.b(a + 1.0)
    on_disk = load_file(threaded)
    assert torch.equal(on_disk["a"], a) and torch.equal(on_disk["b"], b)


def test_reader_checks_the_header_without_torch(tmp_path):
    import subprocess
    import sys

    path = dump_model(Wrapped().eval(), _inputs(torch.randn(2, 4)), tmp_path / "d.safetensors")
    code = (
        "import sys; from modeltap.dump import load_dump; "
        f"d = load_dump({str(path)!r}); print(len(d.stats), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False"]
    # Tensors that overlap or leave gaps are refused as safetensors refuses them.
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["inner.0"]["data_offsets"][0] += 4
    bad = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad + raw[8 + n :])
    with pytest.raises(DumpFormatError, match="not a readable safetensors file"):
        load_dump(tmp_path / "bad.safetensors")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stream_through_pinned_memory(tmp_path):
    expected = {k: v for k, v in _mixed_tensors().items() if v.numel()}
    on_gpu = {k: v.cuda() for k, v in expected.items()}
    writer = _write_all(tmp_path / "d.safetensors", on_gpu, mutate=True, max_inflight=1024)
    loaded = load_file(tmp_path / "d.safetensors")
    for key, value in expected.items():
        assert torch.equal(loaded[key], value.contiguous()), key
        if value.is_floating_point():
            ref = value.double()
            stats = writer.stats[key]
            assert stats.mean == pytest.approx(float(ref.mean()), rel=1e-12, abs=1e-15)
            assert stats.norm == pytest.approx(float(ref.norm()), rel=1e-12)
            assert (stats.min, stats.max) == (float(ref.min()), float(ref.max()))
    assert 0 < writer.peak_inflight <= 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_bigger_than_the_buffer_is_written_inline(tmp_path):
    x = torch.randn(1000, 300, device="cuda")
    with DumpWriter(tmp_path / "d.safetensors", max_inflight=4096) as writer:
        writer.tensor("x", x)
        path = writer.finish({})
    assert torch.equal(load_file(path)["x"], x.cpu())


def test_final_tensors_get_their_statistics_from_the_workers(tmp_path):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tensors = {
        "big": torch.randn(2, 3, 300_000),  # the size that goes to the writer thread otherwise
        "small": torch.relu(torch.randn(2, 3, 8)),
        "nan": torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]]),
        "flat": torch.randn(10) + 3.0,
    }
    with DumpWriter(tmp_path / "f.safetensors", stats_only=True, row_mask=mask) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value, final=True)
        writer.finish({})
    got = load_dump(tmp_path / "f.safetensors").stats
    assert list(got) == list(tensors)
    for key in ("big", "small", "flat"):
        x = tensors[key].double()
        assert got[key].mean == pytest.approx(x.mean().item(), rel=1e-6, abs=1e-7), key
        assert got[key].std == pytest.approx(x.std().item(), rel=1e-6), key
        assert (got[key].min, got[key].max) == (x.min().item(), x.max().item()), key
    assert got["small"].dead == int((tensors["small"][mask.bool()].amax(0) <= 0).sum())
    assert got["nan"] == tensor_stats(tensors["nan"])  # NaN/Inf: the finite values' moments
    assert (got["nan"].nan, got["nan"].inf, got["nan"].mean) == (1, 1, -0.5)


def _timeline_dump(path, monkeypatch, **kwargs):
    """A dump with tensors of every route: deferred (small), the writer thread, inline (larger
    than the thread's buffer) and `final` (stats-only workers)."""
    import modeltap.dump.writer as dump_module

    monkeypatch.setattr(dump_module, "_THREAD_MIN_BYTES", 4096)
    g = torch.Generator().manual_seed(7)
    tensors = {
        "small": torch.randn(3, 5, generator=g),
        "small2": torch.randn(7, generator=g),
        "threaded": torch.randn(4, 64, 16, generator=g),
        "inline": torch.randn(64, 300, generator=g),  # 76,800 bytes: more than the buffer
    }
    with DumpWriter(path, max_inflight=1 << 16, **kwargs) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value)
        writer.alias("again", "small")
        writer.finish({})
    return writer


def test_timeline_has_one_ordered_record_per_tensor(tmp_path, monkeypatch):
    from modeltap.dump import timeline

    log = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("MODELTAP_TIMELINE", str(log))
    writer = _timeline_dump(tmp_path / "d.safetensors", monkeypatch)
    (lines,) = timeline.read(log)
    assert {line["dump"] for line in lines} == {str(tmp_path / "d.safetensors")}
    records = [r for r in lines if "key" in r]
    # one record per tensor stored (not per alias), each with its statistics and write
    assert sorted(r["key"] for r in records) == sorted(load_file(tmp_path / "d.safetensors"))
    assert sorted(r["key"] for r in records) == sorted(writer.stats)
    routes = {r["key"]: r["stats"][2] for r in records}
    assert routes == {
        "small": "deferred",
        "small2": "deferred",
        "threaded": "writer",
        "inline": "main",
    }
    end = lines[-1]
    assert end["event"] == "end" and end["status"] == "done"
    assert 0 <= end["enter"] <= end["settle"] <= end["settled"] <= end["end"]
    for r in records:
        assert end["enter"] <= r["hook"], r
        for what in ("copy", "wait", "stats", "write"):
            if what in r:
                start, stop, _ = r[what]
                assert r["hook"] <= start <= stop <= end["end"], (what, r)
        assert "stats" in r and "write" in r, r
    sizes = {r["key"]: r["bytes"] for r in records}
    assert sizes == {"small": 60, "small2": 28, "threaded": 4 * 64 * 16 * 4, "inline": 64 * 300 * 4}
    figures = timeline.summary(lines)
    assert figures["tensors"] == 4
    assert set(figures["busy"]) == {"main", "writer", "deferred"}


def test_timeline_of_final_tensors_names_the_workers(tmp_path, monkeypatch):
    from modeltap.dump import timeline

    log = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("MODELTAP_TIMELINE", str(log))
    with DumpWriter(tmp_path / "f.safetensors", stats_only=True) as writer:
        writer.tensor("a", torch.randn(8, 16), final=True)
        writer.tensor("b", torch.randn(300, 40), final=True)
        writer.finish({})
    records = [r for r in timeline.read(log)[0] if "key" in r]
    assert {r["key"]: r["stats"][2] for r in records} == {"a": "final", "b": "final"}
    assert all(r["stats"][0] <= r["stats"][1] and "write" not in r for r in records)


def test_no_timeline_when_off(tmp_path, monkeypatch):
    monkeypatch.delenv("MODELTAP_TIMELINE", raising=False)
    writer = _timeline_dump(tmp_path / "d.safetensors", monkeypatch)
    assert writer._timeline is None


def test_next_pass_does_the_small_tensors_and_lets_an_idle_thread_go(tmp_path, monkeypatch):
    import threading

    import modeltap.dump.writer as dump_module
    from modeltap.dump import pipeline

    monkeypatch.setattr(dump_module, "_THREAD_MIN_BYTES", 1024)
    real_write = pipeline.write_at
    gate = threading.Event()

    def held_write(fd, tensor, position):
        gate.wait(5)  # the disk is busy until the test lets it go
        real_write(fd, tensor, position)

    monkeypatch.setattr(pipeline, "write_at", held_write)
    g = torch.Generator().manual_seed(2)
    tensors = {
        "big": torch.randn(32, 32, generator=g),
        "small": torch.randn(5, generator=g),
        "big2": torch.randn(16, 64, generator=g),
    }
    with DumpWriter(tmp_path / "d.safetensors", max_inflight=1 << 16) as writer:
        writer.tensor("big", tensors["big"])
        writer.tensor("small", tensors["small"])
        writer.next_pass()
        assert "small" in writer.stats  # done now, not at the end
        assert writer._pipeline is not None  # busy writing: left to finish
        gate.set()
        writer._pipeline.drain()
        writer.next_pass()
        assert writer._pipeline is None  # idle: gone
        writer.tensor("big2", tensors["big2"])  # a new thread when one is needed
        path = writer.finish({})
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert writer.stats["big2"].norm == pytest.approx(float(tensors["big2"].double().norm()))


def _hooked_outputs(model, names, run):
    """Each named module's output in a forward `run()`, taken by plain forward hooks."""
    seen = {}
    modules = dict(model.named_modules())

    def keep(name):  # a hook that returns nothing, so the module's output stays its own
        def hook(m, a, out):
            if name not in seen:
                seen[name] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        return hook

    handles = [modules[name].register_forward_hook(keep(name)) for name in names]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_dump_verb_writes_what_forward_hooks_see(tmp_path):
    """`modeltap.dump(model, inputs, path, ...)`: a tensor (positional), a dict (keywords); the
    file holds each selected module's output as plain forward hooks see it, and the dump is a
    verb of the facade and of the dump package alike."""
    import modeltap

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ).eval()
    x = torch.randn(2, 4)
    want = _hooked_outputs(model, ["0", "1", "1.1"], lambda: model(x))
    path = modeltap.dump(model, x, tmp_path / "d.safetensors", depth=1)
    on_disk = load_file(path)
    assert set(on_disk) == {"0", "1"}
    for key in ("0", "1"):
        torch.testing.assert_close(on_disk[key], want[key], rtol=0, atol=0)
    path = modeltap.dump(model, {"input": x}, tmp_path / "k.safetensors", include=["1.1"])
    assert set(load_file(path)) == {"1.1"}
    torch.testing.assert_close(load_file(path)["1.1"], want["1.1"], rtol=0, atol=0)
    stats = load_dump(tmp_path / "k.safetensors").stats_for("1.1")
    assert stats.norm == pytest.approx(float(want["1.1"].double().norm()), rel=1e-6)
    import modeltap.dump as package

    assert package is modeltap.dump and package.DumpWriter is DumpWriter


def test_dump_verb_takes_text_with_a_tokenizer_or_what_the_tokenizer_returns(tmp_path, bert_dir):
    from transformers import AutoModel, AutoTokenizer

    import modeltap

    model = AutoModel.from_pretrained(bert_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    names = ["embeddings", "encoder.layer.0", "encoder.layer.1.attention.self.query", "pooler"]
    encoded = tokenizer(["hello world", "a longer second text"], padding=True, return_tensors="pt")
    want = _hooked_outputs(model, names, lambda: model(**encoded))
    texts = ["hello world", "a longer second text"]
    from_text = modeltap.dump(model, texts, tmp_path / "t.safetensors", tokenizer=tokenizer)
    from_encoding = modeltap.dump(model, encoded, tmp_path / "e.safetensors", stats_only=True)
    on_disk = load_dump(from_text)  # embeddings and each layer: aliases of their last LayerNorm
    stats = load_dump(from_encoding)
    for name in names:
        torch.testing.assert_close(on_disk[name], want[name])
        norm = float(want[name].double().norm())
        assert stats.stats_for(name).norm == pytest.approx(norm, rel=1e-5)
    assert load_file(from_encoding) == {}  # stats only
    with pytest.raises(InputError, match="tokenizer"):
        modeltap.dump(model, "hello", tmp_path / "n.safetensors")
    assert not (tmp_path / "n.safetensors").exists()
