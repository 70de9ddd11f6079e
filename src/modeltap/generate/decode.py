"""`generate_model`: `model.generate()` with every step's forward hooked, streamed to one file."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.dump import DEFAULT_MAX_INFLIGHT, DumpWriter
from modeltap.errors import InputError, RunError, first_line
from modeltap.generate.keys import CACHE_MODULE, step_key
from modeltap.generate.options import (
    Decoding,
    StepPlan,
    check_can_generate,
    check_decoder_length,
    check_prompt_length,
)
from modeltap.run import device_name
from modeltap.selection import Selection, select_modules

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.loading import Inputs


class _StepSink:
    """The writer, with each key put under its step; a step whose tensors depend on its being the
    last is held (copies of its one-token outputs) until the next step starts or decoding ends."""

    def __init__(self, writer: DumpWriter, plan: StepPlan) -> None:
        self.writer = writer
        self.plan = plan
        self.step = -1
        self.order: list[str] = []
        self.full_steps: list[int] = []
        self.devices: dict[str, str] = {}
        self._held: list[tuple[str, Any]] | None = None
        self._prefix = step_key(0, "")

    def begin(self, step: int) -> None:
        self._release(full=False)
        if step > 0:
            # the last step's small tensors in one batch, and no idle writer thread left behind
            self.writer.next_pass()
        self.step = step
        self._prefix = step_key(step, "")
        full = self.plan.full(step)
        if full is None:
            self._held = []
            return
        self.writer.stats_only = not full
        if full:
            self.full_steps.append(step)

    def end(self) -> None:
        self._release(full=True)

    def _release(self, *, full: bool) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        self.writer.stats_only = not full
        if full:
            self.full_steps.append(self.step)
        for key, tensor in held:
            self.writer.tensor(key, tensor)

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        key = self._prefix + key  # step_key(self.step, key)
        self.order.append(key)
        self.devices[key] = device_name(tensor.device)
        if self._held is not None:
            self._held.append((key, tensor.detach().clone()))
        else:
            self.writer.tensor(key, tensor)

    def alias(self, key: str, target: str) -> None:
        key = step_key(self.step, key)
        self.order.append(key)
        self.writer.alias(key, step_key(self.step, target))


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
    """
    import torch

    from modeltap.capture import hooks
    from modeltap.run import _RESERVE_PER_MODULE, environment

    plan = plan or StepPlan()
    selection = selection or Selection()
    check_can_generate(model)
    ids = inputs.kwargs.get("input_ids")
    decoding = (decoding or Decoding()).resolve(model, None if ids is None else ids.shape[1])
    beams = decoding.num_beams or 1
    if forced is not None and beams > 1:
        raise InputError(
            f"teacher forcing keeps one sequence per prompt, and the decoding asks for beam "
            f"search ({beams} beams); pass --num-beams 1"
        )
    modules = select_modules(model, selection)
    if ids is not None:
        check_prompt_length(model, ids.shape[1], decoding.new_tokens)
    else:  # audio or image features: only an encoder-decoder's decoder has positions to count
        check_decoder_length(model, decoding.new_tokens)
    reserve = 4096 + _RESERVE_PER_MODULE * len(modules) * (decoding.new_tokens + 1)
    writer = DumpWriter(
        out,
        stats_only=plan.mode == "none",
        dead_threshold=dead_threshold,
        reserve=min(reserve, 64 << 20),
        max_inflight=max_inflight,
    )
    sink = _StepSink(writer, plan)
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
    skipped: dict[str, str] = {}
    loop = _Loop(beams=beams)
    kwargs["stopping_criteria"] = loop.criteria()
    with writer, torch.random.fork_rng(devices=[]):
        torch.manual_seed(decoding.seed)
        sink.begin(0)
        with (
            hooks(model, modules, sink) as rec,
            _steps(model, sink, rec, loop, kv=kv, skipped=skipped),
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
        if beams > 1:
            loop.finish_beams(model, out)
        if not loop.choices.steps:
            raise RunError(
                f"{type(model).__name__}.generate chose no token through transformers' decoding "
                "loop, so modeltap has no step to number; dump one forward with `modeltap dump`"
            )
        done = _generated(model, inputs, loop, tokenizer, decoding, forwards=sink.step + 1)
        skipped.update({step_key(sink.step, k): v for k, v in rec.skipped.items()})
        gen_meta = {
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
            "num_beams": beams,
            "generation_config": _generation_config(model),
        }
        if plan.mode != "none":
            writer.stats_only = False
        meta: dict[str, Any] = {
            "kind": "generation",
            **environment(),
            "model_class": type(model).__name__,
            "seed": str(decoding.seed),
            "train_mode": "false",
            "backend": "eager",
            **(metadata or {}),
            "inputs": json.dumps(inputs.description),
            "selection": json.dumps({**selection.as_dict(), "inputs": False}),
            "order": json.dumps(sink.order),
            "skipped": json.dumps(skipped),
            "skipped_none": str(rec.skipped_none),
            "devices": json.dumps(sink.devices),
            "generate": json.dumps(gen_meta),
        }
        done.path = writer.finish(meta)
        done.meta = gen_meta
    return done


class _Choices:
    """Each step's chosen token, its probability and the runner-up, from the root's logits as each
    step returns them. Only the latest step's distribution is held, until generate appends the
    token it chose (`_Loop.criteria`)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._probs: torch.Tensor | None = None
        # beam search: per step, each row's two likeliest tokens and the probabilities each row
        # gives the tokens of the step's best continuations (the returned tokens are among them)
        self._beam: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def logits(self, output: Any) -> None:
        import torch

        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if isinstance(logits, torch.Tensor):
            self._probs = torch.softmax(logits[:, -1].float(), dim=-1)

    def chosen(self, tokens: torch.Tensor | None) -> None:
        import torch

        probs, self._probs = self._probs, None
        if probs is None or tokens is None:
            return
        tokens = tokens.to(probs.device)
        top = torch.topk(probs, 2, dim=-1).indices
        # the runner-up: the likeliest token other than the chosen one
        second = torch.where(top[:, 0] == tokens, top[:, 1], top[:, 0])
        p = probs.gather(1, tokens[:, None])[:, 0]
        p_second = probs.gather(1, second[:, None])[:, 0]
        self.steps.append(
            {
                "step": len(self.steps),
                "token": tokens.tolist(),
                "p": p.tolist(),
                "second": second.tolist(),
                "p_second": p_second.tolist(),
            }
        )

    def continuations(self, tokens: torch.Tensor) -> None:
        """Beam search: the last tokens of the step's best continuations (which of them go on
        is known only when `generate` returns)."""
        import torch

        probs, self._probs = self._probs, None
        if probs is None:
            return
        top = torch.topk(probs, 2, dim=-1)
        tokens = torch.unique(tokens.to(probs.device))
        self._beam.append(
            (top.indices.cpu(), top.values.cpu(), tokens.cpu(), probs[:, tokens].cpu())
        )

    def beam_steps(self, new: torch.Tensor, rows: torch.Tensor) -> None:
        """Each step's token of each returned sequence (`new`), with the row of the step's
        forward that chose it (`rows`, -1 past a sequence's end: `token` is then padding)."""
        names = ("token", "p", "second", "p_second", "beam")
        for step in range(new.shape[1]):
            top, top_p, tokens, token_p = self._beam[step]
            columns: dict[str, list[Any]] = {name: [] for name in names}
            for token, row in zip(new[:, step].tolist(), rows[:, step].tolist(), strict=True):
                p = second = p_second = None
                if row >= 0:
                    p = float(token_p[row, int((tokens == token).nonzero()[0, 0])])
                    other = 1 if int(top[row, 0]) == token else 0
                    second, p_second = int(top[row, other]), float(top_p[row, other])
                for name, value in zip(names, (token, p, second, p_second, row), strict=True):
                    columns[name].append(value)
            self.steps.append({"step": step, **columns})


@dataclass
class _Loop:
    """What the hooks learn of `generate`'s decoding loop while it runs.

    A root forward is a decoding step only when `generate` prepared its inputs
    (`prepare_inputs_for_generation`); another (Whisper's language detection, before the loop)
    runs with nothing stored. A step ends when generate appends the token it chose, which a
    stopping criterion that never stops sees, whatever `generate` returns afterwards (Whisper
    returns its tokens without the decoder prompt and the EOS); the next decoding forward begins
    the next step."""

    choices: _Choices = field(default_factory=_Choices)
    beams: int = 1
    prepared: bool = False
    chose: bool = False
    # a forward outside the loop is running (the recorder paused)
    outside: bool = False
    unstored: int = 0
    # decoder positions after step 0 (the prompt, or an encoder-decoder's decoder prompt)
    prompt_end: int | None = None
    # the ids the loop started from: an encoder-decoder's decoder prompt
    start_ids: list[list[int]] | None = None

    def criteria(self) -> Any:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        loop = self

        class Chosen(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> Any:
                if loop.start_ids is None:
                    loop.start_ids = input_ids[:, :-1].tolist()
                if loop.beams > 1:  # the step's best continuations, not yet the chosen ones
                    loop.choices.continuations(input_ids[:, -1])
                else:
                    loop.choices.chosen(input_ids[:, -1])
                loop.chose = True
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([Chosen()])

    def finish_beams(self, model: nn.Module, output: Any) -> None:
        """Beam search is over: the returned sequences' tokens step by step, and the decoder
        prompt they start with."""
        rows = getattr(output, "beam_indices", None)
        if rows is None or self.start_ids is None:
            raise InputError(
                f"{type(model).__name__}.generate ran beam search without saying which beam "
                "chose each token, so modeltap can't number its steps; pass --num-beams 1"
            )
        start = len(self.start_ids[0])
        self.start_ids = output.sequences[:, :start].tolist()
        self.choices.beam_steps(output.sequences[:, start:].cpu(), rows.cpu())


@contextmanager
def _steps(
    model: nn.Module,
    sink: _StepSink,
    recorder: Any,
    loop: _Loop,
    *,
    kv: bool,
    skipped: dict[str, str],
) -> Iterator[None]:
    """Number the decoding loop's forwards as steps (a pre-hook that runs before any module's
    hook of the step), aligned by decoder positions: step 0 consumes the P positions of the
    prompt (an encoder-decoder's start and forced tokens), step k the token step k - 1 chose,
    so its positions end at P + k; a forward that does not (the loop run again) is refused.
    With `kv`, hand each step's new cache positions to the sink after its forward."""
    method = "prepare_inputs_for_generation"
    own = vars(model).get(method)
    original = getattr(model, method)

    @functools.wraps(original)
    def prepare(*args: Any, **kwargs: Any) -> Any:
        loop.prepared = True
        return original(*args, **kwargs)

    def before(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not loop.prepared:
            loop.outside = recorder.paused = True
            loop.unstored += 1
            return
        loop.prepared = False
        end = _decoder_end(args, kwargs)
        if not loop.chose:
            if sink.step == 0:  # the prefill (in chunks: several forwards)
                loop.prompt_end = end
            return
        loop.chose = False
        step = sink.step + 1
        if end is not None and loop.prompt_end is not None and end != loop.prompt_end + step:
            raise InputError(
                f"{type(model).__name__}.generate ran its decoding loop again (step {step} ends "
                f"at decoder position {end}, not {loop.prompt_end + step}); modeltap numbers "
                "the steps of one loop: give a recording within the model's window, without "
                "temperature fallback in its generation config"
            )
        skipped.update({step_key(sink.step, k): v for k, v in recorder.skipped.items()})
        recorder.skipped.clear()
        recorder.next_pass()
        sink.begin(step)

    def after(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if loop.outside:
            loop.outside = recorder.paused = False
            return
        loop.choices.logits(output)
        if not kv:
            return
        cache = None
        for name in ("cache", "past_key_values"):  # transformers 5 renamed the field
            if isinstance(output, dict) and output.get(name) is not None:
                cache = output[name]
                break
        new = _step_length(args, kwargs)
        if cache is None or not new:
            return
        for layer, (key, value) in enumerate(_self_attention(cache)):
            sink.tensor(f"{CACHE_MODULE}:{layer}.key", key[..., -new:, :])
            sink.tensor(f"{CACHE_MODULE}:{layer}.value", value[..., -new:, :])

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    setattr(model, method, prepare)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if own is None:
            delattr(model, method)
        else:
            setattr(model, method, own)


def _decoder_end(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The decoder positions after this forward: those in its cache and those it adds (None
    when the cache does not say, as a linear-attention one)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = 0
    if cache is not None:
        try:
            past = int(cache.get_seq_length())
        except (AttributeError, TypeError, ValueError):
            return None
    return past + _step_length(args, kwargs)


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


def _step_length(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Positions this forward adds to the (decoder's) cache."""
    for name in ("decoder_input_ids", "input_ids", "decoder_inputs_embeds", "inputs_embeds"):
        value = kwargs.get(name)
        if value is not None:
            return int(value.shape[1])
    return int(args[0].shape[1]) if args and hasattr(args[0], "shape") else 0


def _self_attention(cache: Any) -> list[tuple[Any, Any]]:
    """(key, value) per layer of a transformers Cache (an encoder-decoder's self-attention part)."""
    cache = getattr(cache, "self_attention_cache", cache)
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [
            (layer.keys, layer.values)
            for layer in layers
            if getattr(layer, "keys", None) is not None
        ]
    return [(k, v) for k, v, *_ in cache]


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
    loop: _Loop,
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
