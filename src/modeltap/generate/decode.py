"""`generate_model`: `model.generate()` with every step's forward hooked, streamed to one file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.dump import DEFAULT_MAX_INFLIGHT, DumpWriter
from modeltap.errors import InputError, RunError, first_line
from modeltap.generate.keys import step_key
from modeltap.generate.loop import Loop, StepSink, hooked_steps
from modeltap.generate.options import (
    Decoding,
    StepPlan,
    check_can_generate,
    check_decoder_length,
    check_prompt_length,
)
from modeltap.selection import Selection, select_modules

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.loading import Inputs


@dataclass
class Generated:
    """What a generation produced besides the file: the ids, texts and per-step choices."""

    prompt_ids: list[list[int]]
    new_ids: list[list[int]]
    texts: list[str]
    steps: list[dict[str, Any]]
    stop: str
    forwards: int
    # an encoder-decoder's decoder prompt: its start token and any forced ones (Whisper's
    # language, task and no-timestamps tokens), which step 0 reads and no step chooses
    decoder_prompt_ids: list[list[int]] = field(default_factory=list)
    # forwards outside the decoding loop (Whisper's language detection): run, not stored
    unstored_forwards: int = 0
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def generate_model(
    model: nn.Module,
    inputs: Inputs,
    out: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    decoding: Decoding | None = None,
    plan: StepPlan | None = None,
    selection: Selection | None = None,
    kv: bool = False,
    forced: list[list[int]] | None = None,
    dead_threshold: float = 0.0,
    metadata: dict[str, str] | None = None,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ops: bool = False,
    formats: Sequence[str] = (),
) -> Generated:
    """Run `model.generate` on `inputs` with the selected modules hooked and stream every step's
    outputs to `out` (keys `gen/step{k}/...`). The file appears only if decoding finished.

    `plan`: which steps keep tensors (default: the prefill and the last; the rest statistics).
    `kv`: also store each step's new self-attention K/V positions (`gen/step{k}/cache:{i}.key`).
    `forced`: new token ids (per row) that each step must choose (teacher forcing: another
    model's generation); the steps' probabilities stay this model's own.
    `decoding`: what the model's generation config says where it leaves a field None, beam
    search included: each step is then the forward of every beam (batch x num_beams rows, beam j
    of prompt b in row b * num_beams + j), and the steps' tokens are those of the sequence
    `generate` returns, each with the row that chose it (`beam`).
    `ops`: also every op of the selected modules' own code at each step (capture/ops.py; keys
    `gen/step{k}/module/opNN.name`, metadata `ops` alike). `formats`: as `dump --formats`."""
    import torch

    from modeltap.capture import hooks

    plan = plan or StepPlan()
    selection = selection or Selection()
    formats = _checked_formats(formats)
    decoding = _checked_decoding(model, inputs, decoding, forced)
    beams = decoding.num_beams or 1
    modules = select_modules(model, selection)
    steps = len(modules) * (decoding.new_tokens + 1)
    writer = _writer(out, plan, steps, ops, formats, dead_threshold, max_inflight)
    sink = StepSink(writer, plan)
    kwargs = _generate_kwargs(model, inputs, decoding, modules, forced, beams)
    skipped: dict[str, str] = {}
    loop = Loop(beams=beams)
    kwargs["stopping_criteria"] = loop.criteria()
    with writer, torch.random.fork_rng(devices=[]):
        torch.manual_seed(decoding.seed)
        sink.begin(0)
        with (
            hooks(model, modules, sink) as rec,
            _op_capture(model, modules, rec, ops) as tracer,
            hooked_steps(model, sink, rec, loop, kv=kv, skipped=skipped, tracer=tracer),
        ):
            try:
                with torch.no_grad():
                    out = model.generate(*inputs.args, **kwargs)
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                raise RunError(
                    f"{type(model).__name__}.generate failed: {first_line(exc)}; check the "
                    "prompt and the decoding options (MODELTAP_DEBUG=1 shows the traceback)"
                ) from exc
        sink.end()
        if tracer is not None:
            sink.take_ops(tracer.meta)
        _check_steps(model, loop, out)
        done = _generated(model, inputs, loop, tokenizer, decoding, forwards=sink.step + 1)
        skipped.update({step_key(sink.step, k): v for k, v in rec.skipped.items()})
        gen_meta = _generation_meta(model, inputs, done, sink, plan, decoding, kv=kv, forced=forced)
        if plan.mode != "none":
            writer.stats_only = False
        meta = {
            **_file_meta(model, inputs, selection, decoding, metadata),
            **_run_meta(sink, skipped, rec.skipped_none, gen_meta, ops=ops),
        }
        done.path = writer.finish(meta)
        done.meta = gen_meta
    return done


def _writer(
    out: str | os.PathLike[str],
    plan: StepPlan,
    module_steps: int,
    ops: bool,
    formats: tuple[str, ...],
    dead_threshold: float,
    max_inflight: int,
) -> DumpWriter:
    """The file's writer, its header's room reserved for `module_steps` module outputs (each
    with its ops and format figures)."""
    from modeltap.dumping import _RESERVE_PER_FORMAT, _RESERVE_PER_MODULE

    per_module = _RESERVE_PER_MODULE * (1 + 4 * ops) + _RESERVE_PER_FORMAT * len(formats)
    return DumpWriter(out, stats_only=plan.mode == "none", dead_threshold=dead_threshold,
                      reserve=min(4096 + per_module * module_steps, 64 << 20),
                      max_inflight=max_inflight, formats=formats)  # fmt: skip


def _run_meta(
    sink: StepSink, skipped: dict[str, str], skipped_none: Any, gen_meta: Any, *, ops: bool
) -> dict[str, str]:
    """The metadata of what the steps recorded: order, skipped keys, devices, the generation,
    and the ops."""
    return {
        "order": json.dumps(sink.order),
        "skipped": json.dumps(skipped),
        "skipped_none": str(skipped_none),
        "devices": json.dumps(sink.devices),
        "generate": json.dumps(gen_meta),
        **({"ops": json.dumps(sink.stored_ops())} if ops else {}),
    }


def _checked_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """The format names, or an InputError that lists the known ones."""
    from modeltap.stats.formats import check_formats

    return tuple(check_formats(formats)) if formats else ()


@contextmanager
def _op_capture(model: nn.Module, modules: list[str], recorder: Any, ops: bool) -> Iterator[Any]:
    """With `ops`, `capture.ops.op_capture` over the whole generation (yields its tracer, which
    `hooked_steps` moves on at each step), else None."""
    if not ops:
        yield None
        return
    from modeltap.capture.ops import op_capture

    with op_capture(model, modules, recorder) as tracer:
        yield tracer


def _generate_kwargs(
    model: nn.Module,
    inputs: Inputs,
    decoding: Decoding,
    modules: list[str],
    forced: list[list[int]] | None,
    beams: int,
) -> dict[str, Any]:
    """What `model.generate` is called with besides the inputs' positional arguments."""
    kwargs = {**inputs.kwargs, **decoding.generate_kwargs()}
    if decoding.do_sample and "temperature" not in kwargs:
        # the model's own temperature, named: Whisper's generate samples only when given one
        # above 0 (it takes do_sample from the temperature), the others read the same value
        config = getattr(model, "generation_config", None)
        kwargs["temperature"] = getattr(config, "temperature", None) or 1.0
    if _takes(model, "logits_to_keep") and _logits_captured(model, modules):
        # every position's logits in the prefill, as a one-forward dump has them (generate asks
        # for the last only); a decoding step has one position either way
        kwargs["logits_to_keep"] = 0
    if forced is not None:
        kwargs["logits_processor"] = _forcing(forced)
    if beams > 1:  # the returned sequences' beam indices: which row chose each token
        kwargs["return_dict_in_generate"] = True
    return kwargs


def _generation_meta(
    model: nn.Module,
    inputs: Inputs,
    done: Generated,
    sink: StepSink,
    plan: StepPlan,
    decoding: Decoding,
    *,
    kv: bool,
    forced: list[list[int]] | None,
) -> dict[str, Any]:
    """The file's `generate` metadata: the prompt, the new ids and texts, each step's choice."""
    return {
        "prompt": inputs.description.get("texts"),
        "prompt_ids": done.prompt_ids,
        **({"decoder_prompt_ids": done.decoder_prompt_ids} if done.decoder_prompt_ids else {}),
        "new_ids": done.new_ids,
        "text": done.texts,
        "steps": done.steps,
        "stop": done.stop,
        "forwards": done.forwards,
        "unstored_forwards": done.unstored_forwards,
        "full_steps": sink.full_steps,
        "plan": plan.describe(),
        "kv": kv,
        "forced": forced is not None,
        "decoding": {**decoding.generate_kwargs(), "seed": decoding.seed},
        "num_beams": decoding.num_beams or 1,
        "generation_config": _generation_config(model),
    }


def _check_steps(model: nn.Module, loop: Loop, output: Any) -> None:
    """Beam search's steps are known once generate returns; a loop that chose no token
    through transformers' decoding loop (a model's own generate) has none to number."""
    if loop.beams > 1:
        loop.finish_beams(model, output)
    if not loop.choices.steps:
        raise RunError(
            f"{type(model).__name__}.generate chose no token through transformers' decoding "
            "loop, so modeltap has no step to number; dump one forward with `modeltap dump`"
        )


def _checked_decoding(
    model: nn.Module, inputs: Inputs, decoding: Decoding | None, forced: list[list[int]] | None
) -> Decoding:
    """The decoding resolved against the model's generation config, refused where the model
    cannot generate, the prompt leaves no room for the new tokens, or forcing meets beams."""
    check_can_generate(model)
    ids = inputs.kwargs.get("input_ids")
    decoding = (decoding or Decoding()).resolve(model, None if ids is None else ids.shape[1])
    beams = decoding.num_beams or 1
    if forced is not None and beams > 1:
        raise InputError(
            f"teacher forcing keeps one sequence per prompt, and the decoding asks for beam "
            f"search ({beams} beams); pass --num-beams 1"
        )
    if ids is not None:
        check_prompt_length(model, ids.shape[1], decoding.new_tokens)
    else:  # audio or image features: only an encoder-decoder's decoder has positions to count
        check_decoder_length(model, decoding.new_tokens)
    return decoding


def _file_meta(
    model: nn.Module,
    inputs: Inputs,
    selection: Selection,
    decoding: Decoding,
    metadata: dict[str, str] | None,
) -> dict[str, str]:
    """The file's metadata of the run (the environment, the model, the inputs, the selection)."""
    from modeltap.dumping import environment

    return {
        "kind": "generation",
        **environment(),
        "model_class": type(model).__name__,
        "seed": str(decoding.seed),
        "train_mode": "false",
        "backend": "eager",
        **(metadata or {}),
        "inputs": json.dumps(inputs.description),
        "selection": json.dumps({**selection.as_dict(), "inputs": False}),
    }


def _forcing(forced: list[list[int]]) -> Any:
    """A logits processor that leaves each row one choice at each step: its forced token."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Forced(LogitsProcessor):
        def __init__(self) -> None:
            self.start: int | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.start is None:
                self.start = input_ids.shape[1]
            step = input_ids.shape[1] - self.start
            out = scores.clone()
            for row, tokens in enumerate(forced):
                if step < len(tokens):
                    out[row] = float("-inf")
                    out[row, tokens[step]] = 0.0
            return out

    return LogitsProcessorList([Forced()])


def _logits_captured(model: nn.Module, modules: list[str]) -> bool:
    """Whether the root or the LM head is selected: only then are the prefill's logits computed
    for every position (with a long prompt and a large vocabulary they are the largest tensor)."""
    from modeltap.selection import ROOT, display_name

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {display_name(n) for n, m in model.named_modules() if m is head}
    return ROOT in modules or bool(names & set(modules))


def _takes(model: nn.Module, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _generation_config(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    try:
        return config.to_diff_dict()
    except (AttributeError, TypeError, ValueError):
        return {}


def _eos_ids(model: nn.Module) -> set[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _generated(
    model: nn.Module,
    inputs: Inputs,
    loop: Loop,
    tokenizer: Any,
    decoding: Decoding,
    *,
    forwards: int,
) -> Generated:
    """Ids (each step's chosen token), texts, each step's choice and probability, and the
    stopping reason."""
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    prompt = inputs.kwargs.get("input_ids")
    choices = loop.choices.steps
    new = [[step["token"][row] for step in choices] for row in range(len(choices[0]["token"]))]
    steps = []
    for step in choices:
        steps.append(
            {
                **step,
                "text": _decode_each(tokenizer, step["token"]),
                "second_text": _decode_each(tokenizer, step["second"]),
            }
        )
    eos = _eos_ids(model)
    n = len(new[0])
    ended = bool(eos) and all(any(t in eos for t in row) for row in new)
    limit = decoding.new_tokens
    if decoding.max_length is not None:  # the decoder prompt counts: Whisper's is 4 tokens
        if encoder_decoder or prompt is None:
            start = len((loop.start_ids or [[]])[0])
        else:
            start = prompt.shape[1]
        limit = decoding.max_length - start
    if ended and (n < limit or all(row[-1] in eos for row in new)):
        stop = "eos"
    elif n >= limit:
        stop = "max_length" if decoding.max_length is not None else "max_new_tokens"
    else:
        stop = "stopping_criteria"
    texts = (
        [tokenizer.decode(row, skip_special_tokens=True) for row in new]
        if tokenizer is not None
        else []
    )
    prompt_ids = prompt.cpu().tolist() if prompt is not None else []
    return Generated(
        prompt_ids, new, texts, steps, stop, forwards,
        decoder_prompt_ids=(loop.start_ids or []) if encoder_decoder else [],
        unstored_forwards=loop.unstored,
    )  # fmt: skip


def _decode_each(tokenizer: Any, ids: list[int | None]) -> list[str | None] | None:
    if tokenizer is None:
        return None
    return [None if i is None else tokenizer.decode([i]) for i in ids]
