import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from modeltap.errors import InputError
from modeltap.loading import (
    Inputs,
    add_decoder_inputs,
    check_forward_names,
    check_length,
    file_inputs,
    load_model,
    load_tokenizer,
    resolve_model,
    text_inputs,
)
from tests.fixtures.hf import hf_cache


@pytest.fixture
def offline_cache(tmp_path, bert_dir, monkeypatch):
    """tiny-bert published as 'org/tiny-bert' in a Hugging Face cache, Hub offline."""
    import huggingface_hub.constants as constants

    home = hf_cache(tmp_path / "hf", "org/tiny-bert", bert_dir, commit="a" * 40)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_hub_id_resolves_through_the_cache(offline_cache, bert_dir):
    source = resolve_model("org/tiny-bert")
    assert source.revision == "a" * 40
    assert (source.path / "config.json").read_text() == (bert_dir / "config.json").read_text()
    loaded = load_model("org/tiny-bert")
    assert loaded.model_class == "BertModel" and not loaded.model.training


def test_uncached_hub_id_offline_says_what_to_do(offline_cache):
    with pytest.raises(InputError, match="not in the Hugging Face cache"):
        resolve_model("org/absent")


def test_local_folder_errors(tmp_path):
    with pytest.raises(InputError, match="no folder './missing'"):
        resolve_model("./missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="is a file"):
        resolve_model(str(tmp_path / "f.bin"))


def test_bad_model_class(bert_dir):
    with pytest.raises(InputError, match="not a transformers model class"):
        load_model(str(bert_dir), model_class_name="AutoNope")


def test_no_tokenizer(tmp_path):
    from tests.fixtures.hf import build_bert

    folder = build_bert(tmp_path / "bare", with_tokenizer=False)
    with pytest.raises(InputError, match="no tokenizer"):
        load_tokenizer(folder)


def test_texts_become_a_padded_batch(bert_dir):
    tok = load_tokenizer(bert_dir)
    inputs = text_inputs(tok, ["hello", "the quick brown fox"])
    mask = inputs.kwargs["attention_mask"]
    assert mask.shape[0] == 2 and mask[0].sum() < mask[1].sum()
    assert inputs.description["texts"] == ["hello", "the quick brown fox"]


def test_gpt2_gets_a_pad_token_for_batches(gpt2_dir):
    tok = load_tokenizer(gpt2_dir)
    inputs = text_inputs(tok, ["hello", "hello world again"])
    assert inputs.description["pad_token"] == "eos_token"


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
def test_named_tensor_files(tmp_path, suffix):
    ids = torch.tensor([[2, 5, 6, 3]])
    path = tmp_path / f"in{suffix}"
    if suffix == ".safetensors":
        save_file({"input_ids": ids}, path)
    elif suffix == ".npz":
        np.savez(path, input_ids=ids.numpy())
    else:
        torch.save({"input_ids": ids}, path)
    inputs = file_inputs(path)
    assert torch.equal(inputs.kwargs["input_ids"], ids)
    assert inputs.description["file"] == path.name and len(inputs.description["sha256"]) == 64


def test_single_unnamed_tensor_is_positional(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2, 3), dtype=np.float32))
    inputs = file_inputs(tmp_path / "x.npy")
    assert inputs.kwargs == {} and inputs.args[0].shape == (2, 3)


def test_pickles_are_never_unpickled(tmp_path):
    from tests.fixtures.models import Evil

    torch.save({"input_ids": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(InputError, match="never unpickles"):
        file_inputs(tmp_path / "evil.pt")


def test_bad_input_files(tmp_path):
    with pytest.raises(InputError, match="no input file"):
        file_inputs(tmp_path / "absent.safetensors")
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(InputError, match="unknown type"):
        file_inputs(tmp_path / "x.csv")
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match="can't read input file"):
        file_inputs(tmp_path / "bad.safetensors")


def test_wrong_input_names_name_the_right_ones(tmp_path, bert_dir):
    model = load_model(str(bert_dir)).model
    save_file({"input_idz": torch.tensor([[1, 2]])}, tmp_path / "in.safetensors")
    with pytest.raises(InputError, match="did you mean 'input_ids'|one of: input_ids"):
        check_forward_names(model, file_inputs(tmp_path / "in.safetensors"))


def test_encoder_decoder_gets_decoder_start(t5_dir):
    model = load_model(str(t5_dir)).model
    inputs = file_inputs_from({"input_ids": torch.tensor([[4, 5, 6], [7, 8, 9]])})
    completed = add_decoder_inputs(model, inputs)
    assert completed.kwargs["decoder_input_ids"].tolist() == [[0], [0]]
    with torch.no_grad():
        model(**completed.kwargs)  # runs


def test_models_that_take_no_decoder_ids_get_none():
    """DETR is an encoder-decoder whose decoder starts from learned queries, not token ids."""
    from tests.fixtures.architectures import detr

    model, kwargs = detr()
    assert model.config.is_encoder_decoder
    completed = add_decoder_inputs(model, file_inputs_from(kwargs))
    assert completed.kwargs.keys() == {"pixel_values"}


def file_inputs_from(tensors):
    from modeltap.loading import Inputs

    return Inputs((), tensors, {})


def test_one_text_with_a_tokenizer_without_pad_token(tmp_path):
    from transformers import AutoTokenizer

    from tests.fixtures.hf import build_gpt2

    folder = build_gpt2(tmp_path / "gpt2")
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.pad_token is None
    inputs = text_inputs(tok, ["hello world"], max_length=2)
    assert inputs.kwargs["input_ids"].tolist() == [tok("hello world")["input_ids"][:2]]
    assert tok.pad_token is None  # nothing was padded, nothing borrowed


def test_text_longer_than_the_model_is_left_to_check_length(bert_dir):
    # transformers warns about it (once per tokenizer, on a handler bound to whatever stderr was
    # then); the CLI's one-line error from check_length says it, with the fix. Caught on
    # transformers' own logger, at its warning level, whatever propagation and verbosity are.
    import logging

    from transformers.utils import logging as hf_logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    tok = load_tokenizer(bert_dir)
    long_text = " ".join(["hello world"] * 100)  # > 64 positions of the tiny BERT
    logger, keep, verbosity = logging.getLogger("transformers"), Keep(), hf_logging.get_verbosity()
    logger.addHandler(keep)
    hf_logging.set_verbosity_warning()
    try:
        inputs = text_inputs(tok, [long_text])
    finally:
        logger.removeHandler(keep)
        hf_logging.set_verbosity(verbosity)
    assert inputs.kwargs["input_ids"].shape[1] > 64
    assert not [r for r in records if "sequence length" in r.getMessage()]


@pytest.mark.parametrize("limit", [-1, 0, None])
def test_a_model_without_a_position_limit_takes_any_length(limit):
    """XLNet's config says -1 ("no sequence length limit"); relative or rotary models may declare
    0 or nothing: none of them is a limit."""
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.config = SimpleNamespace(max_position_embeddings=limit)
    check_length(model, Inputs((), {"input_ids": torch.ones(1, 5, dtype=torch.long)}, {}))


def test_xlnet_config_has_no_position_limit():
    from transformers import XLNetConfig, XLNetModel

    model = XLNetModel(XLNetConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, d_inner=32))
    assert model.config.max_position_embeddings == -1  # transformers' "no limit"
    check_length(model, Inputs((), {"input_ids": torch.ones(1, 300, dtype=torch.long)}, {}))


def test_a_text_past_a_real_limit_is_refused_with_the_fix():
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.config = SimpleNamespace(max_position_embeddings=4)
    with pytest.raises(InputError, match=r"at most 4 tokens .* has 5; .*--max-length 4"):
        check_length(model, Inputs((), {"input_ids": torch.ones(1, 5, dtype=torch.long)}, {}))


# --- #29: a checkpoint without weights for the class it is loaded as ------------------------


def _transformers_missing(folder, auto: str) -> list[str]:
    """transformers' own report of the parameters it initialised because the checkpoint had
    none (its loading info), for reference."""
    import transformers

    model, info = getattr(transformers, auto).from_pretrained(folder, output_loading_info=True)
    names = dict(model.named_parameters(remove_duplicate=False))
    return sorted(set(info["missing_keys"]) & names.keys())


def test_a_head_the_checkpoint_lacks_is_refused_naming_the_fix(bert_dir):
    from modeltap.errors import MissingWeightsError

    expected = _transformers_missing(bert_dir, "AutoModelForMaskedLM")
    assert expected and all(k.startswith("cls.") for k in expected)
    with pytest.raises(MissingWeightsError) as caught:
        load_model(str(bert_dir), model_class_name="AutoModelForMaskedLM")
    assert caught.value.missing == expected
    message = caught.value.message
    assert f"{len(expected)} parameter(s) of BertForMaskedLM" in message
    assert "--model-class BertModel" in message and "--allow-missing-weights" in message
    loaded = load_model(
        str(bert_dir), model_class_name="AutoModelForMaskedLM", allow_missing_weights=True
    )
    assert loaded.missing_weights == expected


def test_tied_heads_and_rebuilt_buffers_are_not_missing(gpt2_dir, minilm_dir):
    from safetensors import safe_open

    with safe_open(str(gpt2_dir / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert not any(k.endswith("lm_head.weight") for k in stored)  # tied to wte: not saved
    loaded = load_model(str(gpt2_dir), model_class_name="AutoModelForCausalLM")
    assert loaded.missing_weights == []
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    # README command 1: the real MiniLM as AutoModel
    minilm = load_model(str(minilm_dir))
    assert minilm.missing_weights == [] and minilm.model_class == "BertModel"


def test_missing_parameters_leaves_out_buffers_and_loaded_aliases(gpt2_dir, bert_dir):
    import transformers

    from modeltap.loading.hf import missing_parameters

    bert = transformers.AutoModel.from_pretrained(bert_dir)
    assert "embeddings.position_ids" in dict(bert.named_buffers())
    assert missing_parameters(bert, {"embeddings.position_ids"}) == []
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir)
    assert missing_parameters(model, {"lm_head.weight"}) == []  # wte.weight loaded
    both = {"lm_head.weight", "transformer.wte.weight", "transformer.ln_f.bias"}
    assert missing_parameters(model, both) == sorted(both)


def test_the_resolver_loads_the_model_and_its_inputs_as_transformers_does(
    bert_dir, tmp_path
) -> None:
    # loading/resolve.py: what every command loads through, against transformers called directly
    import transformers

    from modeltap.config import load_settings
    from modeltap.loading.resolve import resolve, run_metadata

    texts = ["hello world", "a longer second sentence"]
    s = load_settings("dump", flags={"model": str(bert_dir), "texts": texts}, cwd=tmp_path)
    notes: list[str] = []
    done = resolve(s, note=notes.append)
    want = transformers.AutoTokenizer.from_pretrained(bert_dir)(
        texts, return_tensors="pt", padding=True
    )
    for name, value in want.items():
        assert torch.equal(done.inputs.kwargs[name], value), name
    reference = transformers.AutoModel.from_pretrained(bert_dir).state_dict()
    got = done.loaded.model.state_dict()
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    assert done.backend is None and done.tokenizer is not None and notes == []
    meta = {"model": str(bert_dir), "dtype": "float32", "device": "cpu"}
    assert run_metadata(s, done.loaded) == meta
