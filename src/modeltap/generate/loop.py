"""What the hooks learn of `generate`'s decoding loop while it runs: the step each forward
belongs to (`hooked_steps`, `Loop`), each step's chosen token and its probability (`Choices`), and
the writer with each key put under its step (`StepSink`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.dump import DumpWriter
from modeltap.dumping import device_name
from modeltap.errors import InputError
from modeltap.generate.keys import CACHE_MODULE, step_key
from modeltap.generate.options import StepPlan

if TYPE_CHECKING:
    import torch
    from torch import nn


class StepSink:
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
        self.ops: dict[str, Any] = {}  # with ops: each op's metadata, under its step's key

    def take_ops(self, meta: dict[str, Any]) -> None:
        """The op tracer's metadata of this step, under the step's keys (the tracer's is then
        empty for the next step)."""
        self.ops.update({self._prefix + key: value for key, value in meta.items()})
        meta.clear()

    def stored_ops(self) -> dict[str, Any]:
        """The ops' metadata of the keys stored (not those of forwards outside the loop)."""
        stored = set(self.order)
        return {key: value for key, value in self.ops.items() if key in stored}

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


class Choices:
    """Each step's chosen token, its probability and the runner-up, from the root's logits as each
    step returns them. Only the latest step's distribution is held, until generate appends the
    token it chose (`Loop.criteria`)."""

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

    def beamhooked_steps(self, new: torch.Tensor, rows: torch.Tensor) -> None:
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
class Loop:
    """What the hooks learn of `generate`'s decoding loop while it runs.

    A root forward is a decoding step only when `generate` prepared its inputs
    (`prepare_inputs_for_generation`); another (Whisper's language detection, before the loop)
    runs with nothing stored. A step ends when generate appends the token it chose, which a
    stopping criterion that never stops sees, whatever `generate` returns afterwards (Whisper
    returns its tokens without the decoder prompt and the EOS); the next decoding forward begins
    the next step."""

    choices: Choices = field(default_factory=Choices)
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
        self.choices.beamhooked_steps(output.sequences[:, start:].cpu(), rows.cpu())


@contextmanager
def hooked_steps(
    model: nn.Module,
    sink: StepSink,
    recorder: Any,
    loop: Loop,
    *,
    kv: bool,
    skipped: dict[str, str],
    tracer: Any = None,
) -> Iterator[None]:
    """Number the decoding loop's forwards as steps (a pre-hook that runs before any module's
    hook of the step), aligned by decoder positions: step 0 consumes the P positions of the
    prompt (an encoder-decoder's start and forced tokens), step k the token step k - 1 chose,
    so its positions end at P + k; a forward that does not (the loop run again) is refused.
    With `kv`, hand each step's new cache positions to the sink after its forward. With an op
    `tracer` (capture/ops.py), each step's ops are keyed as one forward's, their metadata under
    the step (`StepSink.take_ops`), and a forward outside the loop records none."""
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
            if tracer is not None:
                tracer.paused = True
            return
        loop.prepared = False
        end = _decoder_end(args, kwargs)
        if not loop.chose:
            if sink.step == 0:  # the prefill (in chunks: several forwards)
                loop.prompt_end = end
            return
        loop.chose = False
        step = sink.step + 1
        _check_position(model, step, end, loop.prompt_end)
        skipped.update({step_key(sink.step, k): v for k, v in recorder.skipped.items()})
        recorder.skipped.clear()
        recorder.next_pass()
        if tracer is not None:
            sink.take_ops(tracer.meta)
            tracer.next_pass()
        sink.begin(step)

    def after(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if loop.outside:
            loop.outside = recorder.paused = False
            if tracer is not None:  # its ops are none of a step's
                tracer.paused = False
                tracer.next_pass()
            return
        loop.choices.logits(output)
        if kv:
            _new_cache_positions(sink, args, kwargs, output)

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


def _check_position(model: nn.Module, step: int, end: int | None, prompt_end: int | None) -> None:
    """Refuse a step whose decoder positions don't end at the prompt's end + step: the loop ran
    again (a temperature fallback, a window's next chunk)."""
    if end is not None and prompt_end is not None and end != prompt_end + step:
        raise InputError(
            f"{type(model).__name__}.generate ran its decoding loop again (step {step} ends "
            f"at decoder position {end}, not {prompt_end + step}); modeltap numbers "
            "the steps of one loop: give a recording within the model's window, without "
            "temperature fallback in its generation config"
        )


def _new_cache_positions(sink: StepSink, args: Any, kwargs: dict[str, Any], output: Any) -> None:
    """The self-attention K/V positions this forward added to the cache, to the sink."""
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
