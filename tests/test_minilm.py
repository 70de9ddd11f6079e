"""The real pretrained all-MiniLM-L6-v2, offline: what a user's first command runs on."""

import pytest
import torch
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.dump import load_dump
from tests.fixtures.hf import hf_cache

TEXTS = ["hello world", "modeltap reads every layer of a real model"]


@pytest.fixture
def minilm_as_hub_id(minilm_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    home = hf_cache(
        tmp_path / "hf", "sentence-transformers/all-MiniLM-L6-v2", minilm_dir, commit="c" * 40
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return "sentence-transformers/all-MiniLM-L6-v2"


def test_dump_layers_equal_plain_transformers_hidden_states(minilm_as_hub_id, minilm_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    result = CliRunner().invoke(app, ["dump", minilm_as_hub_id, *TEXTS, "-o", "mini.safetensors"])
    assert result.exit_code == 0, result.output
    dump = load_dump(tmp_path / "mini.safetensors")
    assert dump.metadata["revision"] == "c" * 40
    assert dump.metadata["model"] == minilm_as_hub_id

    # The reference: plain transformers, nothing of modeltap's.
    model = AutoModel.from_pretrained(minilm_dir).eval()
    batch = AutoTokenizer.from_pretrained(minilm_dir)(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**batch, output_hidden_states=True)
    assert len(ref.hidden_states) == 7
    assert torch.equal(dump["embeddings"], ref.hidden_states[0])
    for i in range(6):
        assert torch.equal(dump[f"encoder.layer.{i}"], ref.hidden_states[i + 1]), i
        stats = dump.stats_for(f"encoder.layer.{i}")
        assert stats.norm == pytest.approx(
            float(ref.hidden_states[i + 1].double().norm()), rel=1e-6
        )
    assert torch.equal(dump["__root__:pooler_output"], ref.pooler_output)
