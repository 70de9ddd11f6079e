"""Decoding steps as a sequence of captures: `model.generate()` with every step's forward hooked.

Modules: `keys` (the step prefix), `options` (Decoding, StepPlan, prompt and checks), `decode`
(`generate_model`), `loop` (what the hooks learn of generate's decoding loop: steps, choices),
`reader` (`step_view` and the metadata), `verb` (`generate`: the verb from Python). This package
is also the verb: `modeltap.generate(model, tokenizer, prompt, path)` calls `verb.generate`
(`_lazy.callable_package`).

Step 0 is the prompt's forward (the prefill; for an encoder-decoder the encoder's forward too), step
k the forward that takes the k-th new token, using the KV cache; step k chooses new token k + 1.
Each step's keys are a one-forward dump's keys under `gen/step{k}/`, so a step read through
`step_view` is an ordinary `Dump` that `show` and `diff` handle as they handle any dump. The number
of steps is not known in advance: a step is a forward of generate's decoding loop, counted as it
starts, and ends when generate appends its token. Steps are aligned by decoder positions, not by
what generate returns: step 0 reads the P positions of the prompt (an encoder-decoder's decoder
prompt: its start token and any forced ones, four for Whisper), step k ends at position P + k.

Metadata `generate` (JSON): the prompt, its ids (an encoder-decoder's decoder prompt too), the new
ids and text of each row, each step's chosen token with its probability and the runner-up, which
steps hold tensors, forwards outside the loop, and why decoding stopped.
"""

from modeltap._lazy import callable_package
from modeltap.generate.decode import Generated, generate_model
from modeltap.generate.keys import CACHE_MODULE, STEP_PREFIX, split_step, step_key
from modeltap.generate.options import (
    Decoding,
    StepPlan,
    check_can_generate,
    check_prompt_length,
    prompt_inputs,
)
from modeltap.generate.reader import StepDump, generation_meta, step_view, steps_of

__all__ = [
    "CACHE_MODULE",
    "STEP_PREFIX",
    "Decoding",
    "Generated",
    "StepDump",
    "StepPlan",
    "check_can_generate",
    "check_prompt_length",
    "generate_model",
    "generation_meta",
    "prompt_inputs",
    "split_step",
    "step_key",
    "step_view",
    "steps_of",
]

callable_package(__name__, "modeltap.generate.verb", "generate")
