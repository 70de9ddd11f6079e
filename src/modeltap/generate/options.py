"""What to decode and what to keep: `Decoding`, `StepPlan`, the prompt, and the checks made
before a model runs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    from torch import nn

    from modeltap.loading import Inputs


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


# What `modeltap generate` decodes when neither the user nor the generation config says
DEFAULT_MAX_NEW_TOKENS = 20
# The generation config's settings that change how `generate` decodes, named in a refusal
_MODES = {
    "contrastive_search": ("penalty_alpha", "contrastive search"),
    "group_beam_search": ("num_beam_groups", "group beam search"),
    "constrained_beam_search": ("constraints/force_words_ids", "constrained beam search"),
    "assisted_generation": ("prompt_lookup_num_tokens", "assisted generation"),
    "dola_generation": ("dola_layers", "DoLa decoding"),
}


@dataclass(frozen=True)
class Decoding:
    """How `generate` decodes. A field left None is the model's generation config's, as
    `model.generate()` reads it: greedy, sampling (seeded by `seed`) or beam search, and its
    length (`max_new_tokens`, else its `max_length`, else 20 new tokens). Everything else (EOS,
    pad, repetition penalty, length penalty...) comes from the generation config too."""

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    seed: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    num_beams: int | None = None
    # set by `resolve` when the generation config's `max_length` bounds the run instead
    max_length: int | None = None

    def check(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError(
                f"--max-new-tokens is {self.max_new_tokens}; give 1 or more new tokens"
            )
        if self.num_beams is not None and self.num_beams < 1:
            raise InputError(f"--num-beams is {self.num_beams}; give 1 or more")
        sampling = {"--temperature": self.temperature, "--top-k": self.top_k}
        sampling["--top-p"] = self.top_p
        given = [name for name, value in sampling.items() if value is not None]
        if given and self.do_sample is False:
            raise InputError(f"{given[0]} shapes sampling; add --do-sample (greedy ignores it)")
        if self.temperature is not None and self.temperature <= 0:
            raise InputError(f"--temperature is {self.temperature}; give a value above 0")
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"--top-k is {self.top_k}; give 1 or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"--top-p is {self.top_p}; give a value in (0, 1]")

    def resolve(self, model: nn.Module, prompt_tokens: int | None = None) -> Decoding:
        """These options with the model's generation config filled in: what `model.generate()`
        runs when given them. A setting modeltap can't number step by step (contrastive or
        group beam search, constraints, assisted decoding, several sequences per prompt) is
        refused in one line naming what to change; what it runs gives `model.generate()`'s
        tokens."""
        import copy

        self.check()
        own = getattr(model, "generation_config", None)
        config = copy.deepcopy(own) if own is not None else None
        where = "the model's generation config (generation_config.json)"
        do_sample = self.do_sample
        num_beams = self.num_beams
        if config is not None:
            if do_sample is None:
                do_sample = bool(config.do_sample)
            if num_beams is None:
                num_beams = config.num_beams or 1
            config.do_sample, config.num_beams = do_sample, num_beams
            mode = str(getattr(config.get_generation_mode(), "value", ""))
            if mode in _MODES:
                setting, what = _MODES[mode]
                fix = (
                    "pass --num-beams 1"
                    if mode == "group_beam_search"
                    else f"unset {setting} in it"
                )
                raise InputError(
                    f"{where} asks for {what} ({setting}), which modeltap can't record step by "
                    f"step; {fix}"
                )
            returned = config.num_return_sequences or 1
            if returned > 1:
                raise InputError(
                    f"{where} asks for num_return_sequences={returned}; modeltap records one "
                    "sequence per prompt: set it to 1 there"
                )
        do_sample, num_beams = bool(do_sample), num_beams or 1
        if not do_sample and any(v is not None for v in (self.temperature, self.top_k, self.top_p)):
            what = "beam search" if num_beams > 1 else "greedy decoding"
            raise InputError(
                f"{where} decodes by {what}: --temperature/--top-k/--top-p shape sampling; add "
                "--do-sample"
            )
        max_new, max_length = self.max_new_tokens, None
        if max_new is None and config is not None:
            max_new = config.max_new_tokens
            if max_new is None and config.max_length is not None:
                encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
                if encoder_decoder or prompt_tokens is None:
                    max_length = int(config.max_length)  # decoder positions, its prompt's too
                else:
                    max_new = int(config.max_length) - prompt_tokens
                    if max_new < 1:
                        raise InputError(
                            f"{where} has max_length={config.max_length} and the prompt takes "
                            f"{prompt_tokens} tokens, leaving none to generate; pass "
                            "--max-new-tokens"
                        )
        if max_new is None and max_length is None:
            max_new = DEFAULT_MAX_NEW_TOKENS
        return replace(
            self, max_new_tokens=max_new, max_length=max_length, do_sample=do_sample,
            num_beams=num_beams,
        )  # fmt: skip

    @property
    def new_tokens(self) -> int:
        """At most how many new tokens (an encoder-decoder's `max_length` counts its start
        token: one fewer)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return (self.max_length or DEFAULT_MAX_NEW_TOKENS + 1) - 1

    def generate_kwargs(self) -> dict[str, Any]:
        """The keywords `generate` takes for these (resolved) options."""
        kwargs: dict[str, Any] = {"do_sample": bool(self.do_sample)}
        kwargs["num_beams"] = self.num_beams or 1
        if self.max_length is not None:
            kwargs["max_length"] = self.max_length
        else:
            kwargs["max_new_tokens"] = self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
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


def check_decoder_length(model: nn.Module, max_new_tokens: int) -> None:
    """An encoder-decoder's decoder starts from at least one token and has its own positions
    (Whisper's `max_target_positions`, BART's `max_position_embeddings`; T5's are relative)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_target_positions", None)
    if not isinstance(limit, int):
        limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and max_new_tokens + 1 > limit:
        raise InputError(
            f"{type(model).__name__}'s decoder has {limit} positions and starts from at least one "
            f"token: at most {limit - 1} new ones fit; lower --max-new-tokens"
        )


def check_prompt_length(model: nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit the model's positions (past them a learned position
    embedding fails with an index error deep inside the model)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        check_decoder_length(model, max_new_tokens)
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
