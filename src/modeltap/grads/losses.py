"""Whole-model losses of `grads --loss`: next-token (lm) and masked-token (mlm) cross-entropy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn



# Share of maskable tokens masked by --loss mlm (BERT's), at least one per sequence.
MLM_FRACTION = 0.15



def _causal_class_names() -> set[str]:
    from transformers.models.auto import modeling_auto

    return set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())



def check_causal(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in _causal_class_names():
        raise InputError(
            f"--loss lm needs a causal LM, and {name} is not one; load one with "
            "--model-class AutoModelForCausalLM, or use --loss sum or --target"
        )



def lm_loss(output: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Next-token cross-entropy of the input on itself, padding left out (mean over tokens)."""
    import torch

    logits = getattr(output, "logits", None)
    ids = kwargs.get("input_ids")
    if logits is None or ids is None:
        raise InputError("--loss lm needs input_ids and a model that returns logits")
    labels = ids[:, 1:].clone()
    mask = kwargs.get("attention_mask")
    if mask is not None:
        labels[mask[:, 1:] == 0] = -100
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100
    )
    return loss, {"value": float(loss.detach()), "tokens": int((labels != -100).sum())}



def mask_for_mlm(
    model: nn.Module,
    kwargs: dict[str, Any],
    mask_token_id: int | None,
    special_ids: Sequence[int],
    generator: torch.Generator,
) -> tuple[dict[str, Any], torch.Tensor, dict[str, Any]]:
    """Mask MLM_FRACTION of the real tokens (seeded, at least one per row): inputs and labels."""
    import torch
    from transformers.models.auto import modeling_auto

    name = type(model).__name__
    if name not in set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()):
        raise InputError(
            f"--loss mlm needs a masked LM, and {name} is not one; load one with "
            "--model-class AutoModelForMaskedLM, or use --loss sum or --target"
        )
    ids = kwargs.get("input_ids")
    if ids is None or mask_token_id is None:
        raise InputError("--loss mlm needs text input and a tokenizer with a mask token")
    maskable = ~torch.isin(ids, torch.tensor(list(special_ids), dtype=ids.dtype))
    if "attention_mask" in kwargs:
        maskable &= kwargs["attention_mask"].bool()
    scores = torch.rand(ids.shape, generator=generator)
    scores[~maskable] = 2.0
    chosen = torch.zeros_like(maskable)
    for row in range(ids.shape[0]):
        n = int(maskable[row].sum())
        if n == 0:
            continue
        k = max(1, round(MLM_FRACTION * n))
        chosen[row, scores[row].argsort()[:k]] = True
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    masked = dict(kwargs, input_ids=torch.where(chosen, torch.full_like(ids, mask_token_id), ids))
    positions = [[int(i) for i in chosen[r].nonzero()] for r in range(ids.shape[0])]
    return masked, labels, {"masked_positions": positions}



def mlm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    import torch

    logits = getattr(output, "logits", None)
    if logits is None:
        raise InputError("--loss mlm needs a model that returns logits")
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100
    )
