"""Decoding steps as a sequence of captures: `model.generate()` with every step's forward hooked.

Step 0 is the prompt's forward (the prefill; for an encoder-decoder the encoder's forward too), step
k the forward that takes the k-th new token, using the KV cache; step k chooses new token k + 1.
Each step's keys are a one-forward dump's keys under `gen/step{k}/`, so a step read through
`step_view` is an ordinary `Dump` that `show` and `diff` handle as they handle any dump. The number
of steps is not known in advance: a step is a forward of the root module, counted as it starts.

Metadata `generate` (JSON): the prompt, its ids, the new ids and text of each row, each step's
chosen token with its probability and the runner-up, which steps hold tensors, and why decoding
stopped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.dump import DEFAULT_MAX_INFLIGHT, Dump, DumpWriter, load_dump
from modeltap.errors import InputError, RunError, first_line
from modeltap.selection import Selection, select_modules

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.loading import Inputs

STEP_PREFIX = "gen/step"
_STEP_KEY = re.compile(r"^gen/step(\d+)/(.*)$", re.S)
# The self-attention cache's new positions of one step, per layer: `gen/step{k}/cache:{i}.key`.
CACHE_MODULE = "cache"


def step_key(step: int, key: str) -> str:
    return f"{STEP_PREFIX}{step}/{key}"


def split_step(key: str) -> tuple[int, str] | None:
    """(step, one-forward key) of a generation key, None for any other key."""
    match = _STEP_KEY.match(key)
    return (int(match[1]), match[2]) if match else None


@dataclass(frozen=True)
class StepPlan:
    """Which steps keep their tensors (the others keep statistics): `ends` (the prefill and the
    last step, known only when decoding stops), `all`, `none`, or the listed `steps`."""

    mode: str = "ends"
    steps: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> StepPlan:
        """`0,5-9` -> steps 0 and 5 to 9."""
        steps: set[int] = set()
        for part in spec.split(","):
            low, dash, high = part.strip().partition("-")
            try:
                first, last = int(low), int(high if dash else low)
            except ValueError:
                raise InputError(
                    f"--steps '{spec}' is not a list of steps; e.g. --steps 0,5-9"
                ) from None
            if first < 0 or last < first:
                raise InputError(f"--steps '{part.strip()}' is not a step or a rising range N-M")
            steps.update(range(first, last + 1))
        return cls("steps", frozenset(steps))

    def full(self, step: int) -> bool | None:
        """Whether `step` keeps its tensors; None when that depends on its being the last."""
        if self.mode == "all":
            return True
        if self.mode == "none":
            return False
        if self.mode == "steps":
            return step in self.steps
        return True if step == 0 else None

    def describe(self) -> str:
        if self.mode != "steps":
            return self.mode
        return ",".join(str(s) for s in sorted(self.steps))


@dataclass(frozen=True)
class Decoding:
    """How `generate` decodes: greedy by default; sampling with a seed; everything else (EOS, pad,
    repetition penalty...) from the model's own generation config, as transformers uses it."""

    max_new_tokens: int = 20
    do_sample: bool = False
    seed: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(
                f"--max-new-tokens is {self.max_new_tokens}; give 1 or more new tokens"
            )
        sampling = {"--temperature": self.temperature, "--top-k": self.top_k}
        sampling["--top-p"] = self.top_p
        given = [name for name, value in sampling.items() if value is not None]
        if given and not self.do_sample:
            raise InputError(f"{given[0]} shapes sampling; add --do-sample (greedy ignores it)")
        if self.temperature is not None and self.temperature <= 0:
            raise InputError(f"--temperature is {self.temperature}; give a value above 0")
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"--top-k is {self.top_k}; give 1 or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"--top-p is {self.top_p}; give a value in (0, 1]")

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            # one sequence per prompt: a step's chosen token is then the token of its row
            "num_beams": 1,
        }
        for name in ("temperature", "top_k", "top_p"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


def prompt_inputs(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[str],
    *,
    chat: bool = False,
    max_length: int | None = None,
) -> Inputs:
    """The prompts as one batch for `generate`: padded on the left for a decoder-only model (new
    tokens go on the right); with `chat`, each through the tokenizer's chat template as a user
    message, ending with the template's prompt for the assistant's turn."""
    from modeltap.loading import text_inputs

    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(
                "--chat: the tokenizer has no chat template; drop --chat, or pass --tokenizer "
                "with one"
            )
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    else:
        texts = list(prompts)
    if not getattr(model.config, "is_encoder_decoder", False):
        tokenizer.padding_side = "left"
    if not chat:
        return text_inputs(tokenizer, texts, max_length=max_length)
    from modeltap.loading import Inputs

    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    # the template already holds the special tokens (BOS...) the model expects
    encoded = dict(
        tokenizer(texts, return_tensors="pt", padding=len(texts) > 1, add_special_tokens=False)
    )
    description = {"texts": list(prompts), "chat": texts}
    description["tensors"] = {k: list(v.shape) for k, v in encoded.items()}
    return Inputs((), encoded, description)


def check_can_generate(model: nn.Module) -> None:
    """A model without a language-modelling head has no `generate` that decodes anything."""
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        raise InputError(
            f"{type(model).__name__} has no language-modelling head and can't generate; load it "
            "with --model-class AutoModelForCausalLM (or AutoModelForSeq2SeqLM for an "
            "encoder-decoder)"
        )


def check_prompt_length(model: nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit the model's positions (past them a learned position
    embedding fails with an index error deep inside the model)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    if prompt_tokens >= limit:
        raise InputError(
            f"{type(model).__name__} has {limit} positions and the prompt takes {prompt_tokens} "
            "tokens, leaving none to generate; shorten the prompt"
        )
    if prompt_tokens + max_new_tokens > limit:
        raise InputError(
            f"{type(model).__name__} has {limit} positions and the prompt takes {prompt_tokens} "
            f"tokens: at most {limit - prompt_tokens} new ones fit; lower --max-new-tokens"
        )


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

    def begin(self, step: int) -> None:
        self._release(full=False)
        self.step = step
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
        key = step_key(self.step, key)
        self.order.append(key)
        self.devices[key] = str(tensor.device)
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
    """
    import torch

    from modeltap.capture import hooks
    from modeltap.run import _RESERVE_PER_MODULE, environment

    decoding = decoding or Decoding()
    decoding.check()
    plan = plan or StepPlan()
    selection = selection or Selection()
    check_can_generate(model)
    modules = select_modules(model, selection)
    ids = inputs.kwargs.get("input_ids")
    if ids is not None:
        check_prompt_length(model, ids.shape[1], decoding.max_new_tokens)
    reserve = 4096 + _RESERVE_PER_MODULE * len(modules) * (decoding.max_new_tokens + 1)
    writer = DumpWriter(
        out,
        stats_only=plan.mode == "none",
        dead_threshold=dead_threshold,
        reserve=min(reserve, 64 << 20),
        max_inflight=max_inflight,
    )
    sink = _StepSink(writer, plan)
    kwargs = {**inputs.kwargs, **decoding.generate_kwargs()}
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    if _takes(model, "logits_to_keep") and _logits_captured(model, modules):
        # every position's logits in the prefill, as a one-forward dump has them (generate asks
        # for the last only); a decoding step has one position either way
        kwargs["logits_to_keep"] = 0
    if forced is not None:
        kwargs["logits_processor"] = _forcing(forced)
    skipped: dict[str, str] = {}
    with writer, torch.random.fork_rng(devices=[]):
        torch.manual_seed(decoding.seed)
        sink.begin(0)
        with hooks(model, modules, sink) as rec, _steps(model, sink, rec, kv=kv, skipped=skipped):
            try:
                with torch.no_grad():
                    output = model.generate(*inputs.args, **kwargs)
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                raise RunError(
                    f"{type(model).__name__}.generate failed: {first_line(exc)}; check the "
                    "prompt and the decoding options (MODELTAP_DEBUG=1 shows the traceback)"
                ) from exc
        sink.end()
        done = _generated(model, inputs, output, tokenizer, decoding, forwards=sink.step + 1)
        skipped.update({step_key(sink.step, k): v for k, v in rec.skipped.items()})
        gen_meta = {
            "prompt": inputs.description.get("texts"),
            "prompt_ids": done.prompt_ids,
            "new_ids": done.new_ids,
            "text": done.texts,
            "steps": done.steps,
            "stop": done.stop,
            "forwards": done.forwards,
            "full_steps": sink.full_steps,
            "plan": plan.describe(),
            "kv": kv,
            "forced": forced is not None,
            "decoding": {**decoding.generate_kwargs(), "seed": decoding.seed},
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


@contextmanager
def _steps(
    model: nn.Module, sink: _StepSink, recorder: Any, *, kv: bool, skipped: dict[str, str]
) -> Iterator[None]:
    """Count the root's forwards as steps (a pre-hook that runs before any module's hook of the
    step); with `kv`, hand each step's new cache positions to the sink after its forward."""
    calls = [0]

    def before(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if calls[0]:
            skipped.update({step_key(sink.step, k): v for k, v in recorder.skipped.items()})
            recorder.skipped.clear()
            recorder.next_pass()
            sink.begin(sink.step + 1)
        calls[0] += 1

    def after(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
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

    handles = [model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)]
    if kv:
        handles.append(model.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
    output: Any,
    tokenizer: Any,
    decoding: Decoding,
    *,
    forwards: int,
) -> Generated:
    """Ids, texts, each step's choice and probability, and the stopping reason."""
    import torch

    sequences = output.sequences.cpu()
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    prompt = inputs.kwargs.get("input_ids")
    start = 1 if encoder_decoder else (prompt.shape[1] if prompt is not None else 0)
    new = sequences[:, start:]
    steps = []
    for step, logits in enumerate(output.logits):
        probs = torch.softmax(logits.float().cpu(), dim=-1)
        chosen = new[:, step]
        top = torch.topk(probs, 2, dim=-1)
        # the runner-up: the best token other than the chosen one
        second = torch.where(top.indices[:, 0] == chosen, top.indices[:, 1], top.indices[:, 0])
        steps.append(
            {
                "step": step,
                "token": chosen.tolist(),
                "text": _decode_each(tokenizer, chosen.tolist()),
                "p": probs.gather(1, chosen[:, None])[:, 0].tolist(),
                "second": second.tolist(),
                "second_text": _decode_each(tokenizer, second.tolist()),
                "p_second": probs.gather(1, second[:, None])[:, 0].tolist(),
            }
        )
    eos = _eos_ids(model)
    n = new.shape[1]
    ended = bool(eos) and all(any(t in eos for t in row) for row in new.tolist())
    if ended and (n < decoding.max_new_tokens or all(row[-1] in eos for row in new.tolist())):
        stop = "eos"
    elif n >= decoding.max_new_tokens:
        stop = "max_new_tokens"
    else:
        stop = "stopping_criteria"
    texts = (
        [tokenizer.decode(row, skip_special_tokens=True) for row in new.tolist()]
        if tokenizer is not None
        else []
    )
    prompt_ids = prompt.cpu().tolist() if prompt is not None else []
    return Generated(prompt_ids, new.tolist(), texts, steps, stop, forwards)


def _decode_each(tokenizer: Any, ids: list[int]) -> list[str] | None:
    if tokenizer is None:
        return None
    return [tokenizer.decode([i]) for i in ids]


# Reading a generation dump ------------------------------------------------------------------


def generation_meta(dump: Dump) -> dict[str, Any] | None:
    """The `generate` metadata of a generation dump, None for any other file."""
    raw = dump.metadata.get("generate")
    return json.loads(raw) if raw else None


def steps_of(dump: Dump) -> list[int]:
    """The steps that have keys, in order."""
    seen = dict.fromkeys(
        parsed[0] for parsed in map(split_step, dump.order or dump.stored) if parsed
    )
    return sorted(seen)


class StepDump(Dump):
    """One step of a generation dump as an ordinary one-forward `Dump`: its keys without the
    `gen/step{k}/` prefix, its tensors read from the same memory-mapped file."""

    prefix: str = ""

    def _mapping(self) -> tuple[Any, int, dict[str, Any]] | None:
        mapping = super()._mapping()
        if mapping is None:
            return None
        buffer, start, entries = mapping
        n = len(self.prefix)
        return buffer, start, {k[n:]: v for k, v in entries.items() if k.startswith(self.prefix)}

    def __getitem__(self, key: str) -> torch.Tensor:
        target = self.resolve(key)
        if target not in self.stored:
            raise KeyError(key)
        view = self._mapped(target)
        if view is not None:
            return view
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle.get_tensor(self.prefix + target)


def step_view(dump: Dump | str | os.PathLike[str], step: int) -> StepDump:
    """Step `step` of a generation dump, readable as a one-forward dump (show, diff, compare)."""
    dump = dump if isinstance(dump, Dump) else load_dump(dump)
    gen = generation_meta(dump)
    if gen is None:
        raise InputError(f"'{dump.path}' is not a generation dump (written by `modeltap generate`)")
    steps = steps_of(dump)
    if step not in steps:
        raise InputError(
            f"'{dump.path.name}' has steps 0 to {steps[-1] if steps else -1}; no step {step}"
        )
    prefix = step_key(step, "")

    def strip(keys: Any) -> list[str]:
        return [k[len(prefix) :] for k in keys if k.startswith(prefix)]

    meta = dict(dump.metadata)
    full = step in gen.get("full_steps", [])
    meta["stats_only"] = "false" if full else "true"
    meta["order"] = json.dumps(strip(dump.order or []))
    meta["step"] = str(step)
    view = StepDump(
        dump.path,
        meta,
        strip(dump.stored),
        aliases={
            k[len(prefix) :]: v[len(prefix) :]
            for k, v in dump.aliases.items()
            if k.startswith(prefix)
        },
        order=strip(dump.order or []),
        stats={k[len(prefix) :]: v for k, v in dump.stats.items() if k.startswith(prefix)},
    )
    view.prefix = prefix
    return view


__all__ = [
    "CACHE_MODULE",
    "Decoding",
    "Generated",
    "STEP_PREFIX",
    "StepDump",
    "StepPlan",
    "check_can_generate",
    "prompt_inputs",
    "generate_model",
    "generation_meta",
    "split_step",
    "step_key",
    "step_view",
    "steps_of",
]
