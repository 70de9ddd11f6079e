"""A model that generates, with its tokenizer: its LM head (or the seq2seq, speech or
vision-language class the inputs call for) unless --model-class says otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, MissingWeightsError
from modeltap.loading.resolve import Note, check_placement, load_hf

if TYPE_CHECKING:
    from modeltap.config import Settings


def load_generator(
    s: Settings, *, class_given: bool, note: Note | None = None
) -> tuple[Any, Any]:
    """(loaded model, tokenizer) for `s.model`; `class_given`: --model-class was on the command
    line (a config file's AutoModel still means the generating class)."""
    from modeltap.loading import load_tokenizer

    name = s.model or ""
    model_class_name = s.model_class if class_given or s.model_class != "AutoModel" else None
    if model_class_name is None:
        model_class_name = _generative_class(s)
        _check_covered(s, model_class_name)
    if check_placement(s) is not None:
        from modeltap.loading.placement import return_freed_memory

        return_freed_memory()
    try:
        loaded = load_hf(s, model_class_name=model_class_name, note=note)
    except MissingWeightsError as exc:
        from modeltap.loading.hf import describe_names

        raise MissingWeightsError(
            f"'{name}' has no weights for the head {exc.model_class} generates with "
            f"({len(exc.missing)} parameter(s): {describe_names(exc.missing)}), so its tokens "
            "would come from random weights; give a checkpoint saved with a language-modelling "
            "head, --model-class CLASS for one it has, or --allow-missing-weights to run it anyway",
            model_class=exc.model_class,
            missing=exc.missing,
        ) from exc
    from modeltap.generate import check_can_generate

    check_can_generate(loaded.model)
    where = s.tokenizer or loaded.source.path
    try:
        tok = load_tokenizer(where, trust_remote_code=s.trust_remote_code)
    except InputError as exc:  # its hint names --input-file, which generate does not take
        raise InputError(
            f"no tokenizer at '{where}' to read the prompt and the new tokens; pass --tokenizer"
        ) from exc
    return loaded, tok


def _generative_class(s: Settings) -> str:
    """AutoModelForImageTextToText with images, AutoModelForSpeechSeq2Seq with audio,
    AutoModelForSeq2SeqLM for an encoder-decoder, else AutoModelForCausalLM."""
    if s.images:
        return "AutoModelForImageTextToText"
    if s.audio:
        return "AutoModelForSpeechSeq2Seq"
    from modeltap.loading import resolve_model

    source = resolve_model(
        s.model or "", revision=s.revision, trust_remote_code=s.trust_remote_code
    )
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        str(source.path), trust_remote_code=s.trust_remote_code
    )
    return "AutoModelForSeq2SeqLM" if config.is_encoder_decoder else "AutoModelForCausalLM"


def _check_covered(s: Settings, auto: str) -> None:
    """A model type the auto class has no generating class for (ViT, a classifier...) is one
    line naming the fix, not transformers' 'Unrecognized configuration class'."""
    import transformers

    from modeltap.loading import resolve_model

    mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
    if mapping is None or s.trust_remote_code:
        return
    source = resolve_model(s.model or "", revision=s.revision)
    try:
        config = transformers.AutoConfig.from_pretrained(str(source.path))
    except (OSError, ValueError, KeyError):
        return  # load_model says what is wrong with it
    if type(config) in mapping:
        return
    name = s.model or ""
    saved = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
    raise InputError(
        f"'{name}' ({saved}) can't generate text: {auto} has no class for "
        f"{config.model_type} models; give a model that generates (a causal LM, an "
        "encoder-decoder, a vision-language or speech model), or --model-class CLASS"
    )
