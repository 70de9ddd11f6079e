"""Gradients of one module output (or a loss) w.r.t. the outputs of many modules, in one backward.

How: the forward runs with grad enabled and the selected modules hooked. Each selected float
output that is part of the autograd graph gets a tensor hook, and one `torch.autograd.grad` call
from the target asks for the gradients of every graph leaf (trainable parameters, and the leaves
started at frozen modules). The backward pass then runs through every node upstream of the
target once; each tensor hook streams its gradient to the dump as it is computed, so gradients are
never all held at once, and a selected tensor whose hook never fires has no path to the target.

`autograd.grad` never touches `.grad`: the user's parameters come out as they went in.
Tensor hooks receive the gradient w.r.t. the value the module returned, even when the model later
changes that tensor in place.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import flatten, make_key, split_key
from modeltap.dump import GRAD_PREFIX
from modeltap.errors import InputError, SelectionError
from modeltap.selection import ROOT, unknown_name_message

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.dump import DumpWriter

LOSSES = ("sum", "lm", "mlm")
PROBES = ("rademacher", "gaussian")
# Share of maskable tokens masked by --loss mlm (BERT's), at least one per sequence.
MLM_FRACTION = 0.15
# Bytes of batched probe gradients held at once while estimating Jacobian norms.
PROBE_BUDGET = 1 << 30


@dataclass(frozen=True)
class GradSpec:
    """What to differentiate, and how. See the README's `modeltap grads` section."""

    target: str | None = None
    wrt: tuple[str, ...] = ()
    loss: str = "sum"
    grad_output: str = "ones"
    params: bool = False
    jacobian_norm: int = 0
    probes: str = "rademacher"
    vanishing: float = 1e-7
    exploding: float = 1e3

    def check(self) -> None:
        if self.loss not in LOSSES:
            raise InputError(f"--loss must be one of {', '.join(LOSSES)}, got '{self.loss}'")
        if self.target is not None and self.loss != "sum":
            raise InputError(f"--loss {self.loss} is for the whole model; drop --target or --loss")
        if self.loss != "sum" and self.grad_output != "ones":
            raise InputError(f"--grad-output needs a tensor target; --loss {self.loss} is scalar")
        if self.probes not in PROBES:
            raise InputError(f"--probes must be one of {', '.join(PROBES)}, got '{self.probes}'")
        if self.jacobian_norm < 0:
            raise InputError("--jacobian-norm must be 0 (off) or a number of probes")
        if not 0 <= self.vanishing < self.exploding:
            raise InputError("need 0 <= --vanishing < --exploding")
        parse_grad_output(self.grad_output)


def parse_grad_output(spec: str) -> tuple[str, Any]:
    """("ones", None) | ("randn", None) | ("unit", index tuple) | ("file", Path)."""
    if spec in ("ones", "randn"):
        return spec, None
    if spec.startswith("unit:"):
        try:
            index = tuple(int(i) for i in spec[5:].split(","))
        except ValueError:
            raise InputError(
                f"--grad-output '{spec}': give unit:I,J,... with one integer index per dimension "
                "(e.g. unit:0,3,42 for batch 0, token 3, unit 42)"
            ) from None
        return "unit", index
    path = Path(spec)
    if path.suffix.lower() in (".safetensors", ".npy", ".npz", ".pt", ".pth"):
        if not path.is_file():
            raise InputError(f"no --grad-output file '{spec}'; check the path")
        return "file", path
    raise InputError(
        f"--grad-output '{spec}': use ones, randn, unit:I,J,... or a tensor file "
        "(.safetensors, .npy, .pt)"
    )


def seed_tensor(spec: str, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The vector v of the vector-Jacobian product v^T dy/dx."""
    import torch

    kind, arg = parse_grad_output(spec)
    if kind == "ones":
        return torch.ones_like(y)
    if kind == "randn":
        return torch.randn(y.shape, generator=generator, dtype=torch.float32).to(y)
    if kind == "unit":
        if len(arg) != y.dim() or any(not -s <= i < s for i, s in zip(arg, y.shape, strict=True)):
            raise InputError(
                f"--grad-output unit:{','.join(map(str, arg))} is not an index into the target "
                f"of shape {list(y.shape)}; give {y.dim()} indices within it"
            )
        v = torch.zeros_like(y)
        v[arg] = 1
        return v
    from modeltap.loading import file_inputs

    loaded = file_inputs(arg)
    tensors = [*loaded.args, *loaded.kwargs.values()]
    if len(tensors) != 1 or list(tensors[0].shape) != list(y.shape):
        raise InputError(
            f"--grad-output file '{arg.name}' must hold one tensor of the target's shape "
            f"{list(y.shape)}"
        )
    return tensors[0].to(y)


@dataclass
class JacobianNorm:
    """Hutchinson estimate of ||d target / d x||_F from K probes: E ||v^T J||^2 = ||J||_F^2."""

    probes: int
    kind: str
    mode: str  # batched (vmap, is_grads_batched) | loop
    squared: float
    squared_se: float | None

    @property
    def norm(self) -> float:
        return math.sqrt(max(self.squared, 0.0))

    @property
    def norm_se(self) -> float | None:
        # Delta method: se(sqrt(s)) = se(s) / (2 sqrt(s)).
        if self.squared_se is None or self.norm == 0:
            return None
        return self.squared_se / (2 * self.norm)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "norm": self.norm, "norm_se": self.norm_se}


@dataclass
class GradRun:
    meta: dict[str, Any]
    order: list[str]  # activations in execution order, then gradients in backward order
    skipped: dict[str, str]
    skipped_none: int


@dataclass
class _GradSink:
    """Receives the forward's outputs: writes activations if asked, hooks tensors for gradients."""

    writer: DumpWriter
    activations: set[str]  # modules whose outputs are written as activations
    wrt: Callable[[str], bool]  # keys that get gradients
    target: str | None
    keep: bool  # keep references to the wrt tensors (for the Jacobian probes)
    candidates: list[str] = field(default_factory=list)  # wrt keys in forward order
    hooked: dict[str, torch.Tensor] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    no_path: dict[str, str] = field(default_factory=dict)
    grad_aliases: dict[str, str] = field(default_factory=dict)
    y: torch.Tensor | None = None
    # Where each hooked tensor meets the graph: asking autograd for these rather than for the
    # parameters skips every weight gradient nobody stores (without keeping the tensors alive).
    edges: list[Any] = field(default_factory=list)
    live: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seen: dict[str, weakref.ref[Any]] = field(default_factory=dict)

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        if split_key(key)[0] in self.activations:
            self.writer.tensor(key, tensor.detach())
        if key == self.target:
            self.y = tensor
        self._seen[key] = weakref.ref(tensor)
        if not self.wrt(key):
            return
        self.candidates.append(key)
        if not tensor.is_floating_point() and not tensor.is_complex():
            self.no_path[key] = f"{str(tensor.dtype).removeprefix('torch.')}, not float"
        elif not tensor.requires_grad:
            self.no_path[key] = "no path"
        else:
            import torch

            tensor.register_hook(self._writer_hook(key))
            self.edges.append(torch.autograd.graph.get_gradient_edge(tensor))
            self.hooked[key] = tensor if self.keep else None  # type: ignore[assignment]

    def alias(self, key: str, target: str) -> None:
        if split_key(key)[0] in self.activations:
            self.writer.alias(key, target)
        if key == self.target:
            self.y = self._seen[target]()
        if self.wrt(key):
            self.candidates.append(key)
            self.grad_aliases[key] = target

    def _writer_hook(self, key: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.live:
                with self._lock:
                    self.writer.tensor(GRAD_PREFIX + key, grad.detach(), count_zeros=True)
                    self.written.append(key)

        return hook


def run_grads(
    model: nn.Module,
    inputs: Any,
    writer: DumpWriter,
    *,
    spec: GradSpec,
    modules: Sequence[str],
    activations: Sequence[str] = (),
    train_mode: bool = False,
    seed: int = 0,
    mask_token_id: int | None = None,
    special_ids: Sequence[int] = (),
) -> GradRun:
    """Run forward and one backward, streaming gradients (and `activations`) to `writer`.

    `modules` are the selected display names; gradients are taken w.r.t. their outputs, or only
    w.r.t. `spec.wrt` when given. Returns the `grad` metadata (target, loss, seed, no-path keys,
    Jacobian-norm estimates) and the file's key order. Raises InputError or SelectionError for
    what the user must fix.
    """
    import torch

    from modeltap.capture import hooks, run_model
    from modeltap.capture.eager import backward_error, model_mode

    spec.check()
    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    wrt_inputs = [w for w in spec.wrt if w not in by_name and w in inputs.kwargs]
    wrt_modules, wrt_keys = _wrt_sets(
        [w for w in spec.wrt if w not in wrt_inputs], modules, by_name, only_inputs=bool(wrt_inputs)
    )
    hooked = set(wrt_modules) | set(activations)
    target_module = None
    if spec.target is not None:
        target_module = split_key(spec.target)[0]
        if target_module not in by_name:
            raise SelectionError("--target: " + unknown_name_message(target_module, by_name))
        hooked.add(target_module)
    args, kwargs = inputs.args, dict(inputs.kwargs)
    loss_info: dict[str, Any] = {}
    labels = None
    generator = torch.Generator().manual_seed(seed)
    if spec.target is None and spec.loss == "lm":
        _check_causal(model)
    if spec.target is None and spec.loss == "mlm":
        kwargs, labels, loss_info = _mask_for_mlm(
            model, kwargs, mask_token_id, special_ids, generator
        )

    def wanted(key: str) -> bool:
        module = split_key(key)[0]
        return module in wrt_modules and (not wrt_keys or _key_matches(key, wrt_keys))

    sink = _GradSink(
        writer,
        set(activations),
        wanted,
        target=spec.target,
        keep=spec.jacobian_norm > 0,
    )
    frozen = _params_to_enable(model, modules) if spec.params else []
    leaves: list[torch.Tensor] = []
    for name in wrt_inputs:
        kwargs[name] = _input_leaf(name, kwargs[name], sink)

    def start_path(name: str, output: Any) -> Any:
        # A frozen module's output is not in the graph: make it a leaf so gradients can reach it.
        if (
            name in wrt_modules
            and isinstance(output, torch.Tensor)
            and output.is_floating_point()
            and not output.requires_grad
        ):
            leaf = output.detach().requires_grad_()
            leaves.append(leaf)
            return leaf
        return None

    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            position = {name: i for i, name in enumerate(by_name)}
            names = sorted(hooked, key=position.__getitem__)
            with (
                hooks(model, names, sink, train_mode=train_mode, replace=start_path) as recorder,
                torch.enable_grad(),
            ):
                output = run_model(model, args, kwargs)
        y, target_key = _pick_target(spec, sink, output, recorder, model)
        if spec.target is None and spec.loss == "lm":
            y, loss_info = _lm_loss(output, kwargs)
            target_key = "loss:lm"
        elif spec.target is None and spec.loss == "mlm":
            y = _mlm_loss(output, labels)  # type: ignore[arg-type]
            loss_info["value"] = float(y.detach())
            target_key = "loss:mlm"
        if not y.is_floating_point():
            raise InputError(
                f"the target '{target_key}' is {str(y.dtype).removeprefix('torch.')}, not float; "
                "pick a float output (e.g. a hidden state or logits)"
            )
        if not y.requires_grad:
            raise InputError(
                f"no gradient path: '{target_key}' does not depend on anything that takes "
                "gradients; pick a later --target, or --wrt modules upstream of it"
            )
        v = seed_tensor(spec.grad_output, y, generator) if y.dim() else torch.ones_like(y)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        try:
            with model_mode(model, train_mode):
                if not spec.params and sink.edges:
                    # Only down to the hooked tensors: the same hooks fire, no weight gradient is
                    # computed, and nothing is held but what the hooks stream away.
                    torch.autograd.backward(
                        y, v, retain_graph=spec.jacobian_norm > 0, inputs=list(sink.edges)
                    )
                    results: Sequence[Any] = ()
                else:
                    results = torch.autograd.grad(
                        y,
                        [p for _, p in params] + leaves,
                        grad_outputs=v,
                        allow_unused=True,
                        retain_graph=spec.jacobian_norm > 0,
                    )
        except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
            raise backward_error(model, exc, train_mode=train_mode) from exc
        sink.live = False
        reached = set(sink.written)
        for key in sink.hooked:
            if key not in reached:
                sink.no_path[key] = "no path"
        for key, stored in sink.grad_aliases.items():
            if stored in reached:
                writer.alias(GRAD_PREFIX + key, GRAD_PREFIX + stored)
            else:
                sink.no_path[key] = sink.no_path.get(stored, "no path")
        if not reached - {target_key}:
            raise InputError(
                f"no gradient path from '{target_key}' to any selected module; select modules "
                "upstream of it (--wrt, --include, --depth)"
            )
        param_keys = []
        if spec.params:
            selected_ids = {id(p) for name in modules for p in by_name[name].parameters()}
            for (name, p), g in zip(params, results, strict=False):
                if id(p) not in selected_ids:
                    continue
                if g is None:
                    sink.no_path[name] = "no path"
                else:
                    writer.tensor(GRAD_PREFIX + name, g, count_zeros=True)
                    param_keys.append(name)
        del results
        jacobian = {}
        if spec.jacobian_norm:
            xs = [
                k for k in sink.candidates if k in sink.hooked and k in reached and k != target_key
            ]
            estimates = jacobian_norms(
                y, [sink.hooked[k] for k in xs], spec.jacobian_norm, spec.probes, generator
            )
            jacobian = {k: e.to_json() for k, e in zip(xs, estimates, strict=True)}
    finally:
        for p in frozen:
            p.requires_grad_(False)
    order = [k for k in recorder.order if split_key(k)[0] in set(activations)]
    order += [GRAD_PREFIX + k for k in sink.written]
    order += [GRAD_PREFIX + k for k in sink.grad_aliases if k not in sink.no_path]
    order += [GRAD_PREFIX + k for k in param_keys]
    meta = {
        "target": target_key,
        "loss": None if spec.target else spec.loss,
        **({"loss_info": loss_info} if loss_info else {}),
        "grad_output": spec.grad_output if y.dim() else "scalar",
        "seed": seed,
        "wrt": list(spec.wrt),
        "keys": [*sink.candidates, *param_keys],
        "params": param_keys,
        "no_path": sink.no_path,
        "vanishing": spec.vanishing,
        "exploding": spec.exploding,
        **({"jacobian": jacobian} if jacobian else {}),
    }
    return GradRun(meta, order, recorder.skipped, recorder.skipped_none)


def _input_leaf(name: str, value: Any, sink: _GradSink) -> torch.Tensor:
    """A float input of forward (`pixel_values`, `input_features`) as a leaf whose gradient is
    stored as `grad/inputs/NAME`: the gradient w.r.t. the processor's output (saliency)."""
    from modeltap.dump.format import INPUTS_PREFIX

    if not value.is_floating_point():
        raise InputError(
            f"--wrt {name}: {str(value.dtype).removeprefix('torch.')} inputs take no gradient; "
            "ask for the embeddings module's output instead (e.g. --wrt embeddings)"
        )
    import torch

    leaf = value.detach().clone().requires_grad_()
    key = INPUTS_PREFIX + name
    sink.candidates.append(key)
    leaf.register_hook(sink._writer_hook(key))
    sink.edges.append(torch.autograd.graph.get_gradient_edge(leaf))
    sink.hooked[key] = leaf if sink.keep else None  # type: ignore[assignment]
    return leaf


def _wrt_sets(
    wrt: Sequence[str],
    modules: Sequence[str],
    by_name: dict[str, Any],
    *,
    only_inputs: bool = False,
) -> tuple[set[str], set[str]]:
    """(modules to hook for gradients, exact keys asked for, empty when whole modules);
    `only_inputs`: --wrt named inputs of forward alone, so no module gets gradients."""
    if not wrt:
        return (set(), set()) if only_inputs else (set(modules), set())
    names, keys = set(), set()
    for item in wrt:
        module = split_key(item)[0]
        if module not in by_name:
            raise SelectionError("--wrt: " + unknown_name_message(module, by_name))
        names.add(module)
        keys.add(item)
    return names, keys


def _key_matches(key: str, asked: set[str]) -> bool:
    """A whole-module name asks for all its keys; `module:part` or `module@N` for that one."""
    module = split_key(key)[0]
    return key in asked or module in asked


def _pick_target(
    spec: GradSpec, sink: _GradSink, output: Any, recorder: Any, model: nn.Module
) -> tuple[torch.Tensor, str]:
    """The target tensor and its key; for a whole-model loss, the model's main output."""
    import torch

    if spec.target is None:
        leaves = [(p, t) for p, t in flatten(output) if isinstance(t, torch.Tensor)]
        if not leaves:
            raise InputError(f"{type(model).__name__} returned no tensor to take gradients of")
        path, y = leaves[0]
        return y, make_key(ROOT, 0, path)
    if sink.y is not None:
        return sink.y, spec.target
    module = split_key(spec.target)[0]
    parts = [k for k in recorder.order if split_key(k)[0] == module]
    if not parts:
        raise InputError(
            f"--target '{spec.target}': the module did not run in this forward (or returned no "
            "tensor); pick one that does (`modeltap dump` shows which ran)"
        )
    raise InputError(
        f"--target '{spec.target}' names no single tensor; pick one of "
        + ", ".join(parts[:6])
        + (" ..." if len(parts) > 6 else "")
    )


def _params_to_enable(model: nn.Module, modules: Sequence[str]) -> list[torch.nn.Parameter]:
    """Frozen parameters of the selected modules, to unfreeze for the run (--params)."""
    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    seen: dict[int, Any] = {}
    for name in modules:
        for p in by_name[name].parameters():
            if not p.requires_grad and p.is_floating_point():
                seen[id(p)] = p
    return list(seen.values())


def _causal_class_names() -> set[str]:
    from transformers.models.auto import modeling_auto

    return set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _check_causal(model: nn.Module) -> None:
    name = type(model).__name__
    if name not in _causal_class_names():
        raise InputError(
            f"--loss lm needs a causal LM, and {name} is not one; load one with "
            "--model-class AutoModelForCausalLM, or use --loss sum or --target"
        )


def _lm_loss(output: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
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


def _mask_for_mlm(
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


def _mlm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    import torch

    logits = getattr(output, "logits", None)
    if logits is None:
        raise InputError("--loss mlm needs a model that returns logits")
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100
    )


def jacobian_norms(
    y: torch.Tensor,
    xs: Sequence[torch.Tensor],
    probes: int,
    kind: str,
    generator: torch.Generator,
) -> list[JacobianNorm]:
    """Hutchinson estimates of ||dy/dx||_F for every x, from the same `probes` probe vectors.

    Probes go through the graph in batches (`is_grads_batched`, i.e. vmap over the backward)
    sized to PROBE_BUDGET; a model whose backward vmap can't batch falls back to one probe per
    pass. The graph must have been kept (retain_graph) and is freed at the end.
    """
    import torch

    per_probe = sum(x.numel() * x.element_size() for x in xs) or 1
    chunk = max(1, min(probes, PROBE_BUDGET // per_probe))
    squares: list[list[torch.Tensor]] = [[] for _ in xs]
    mode = "batched" if probes > 1 else "loop"
    done = 0
    while done < probes:
        n = min(chunk, probes - done)
        v = _probes(kind, (n, *y.shape), generator).to(y)
        last = done + n >= probes
        grads = None
        if mode == "batched":
            try:
                grads = torch.autograd.grad(
                    y,
                    xs,
                    grad_outputs=v,
                    is_grads_batched=True,
                    retain_graph=True,
                    allow_unused=True,
                )
            except (RuntimeError, NotImplementedError):
                mode = "loop"
        if grads is not None:
            for i, g in enumerate(grads):
                squares[i].append(_squared_norms(g, n))
        else:
            for j in range(n):
                one = torch.autograd.grad(
                    y,
                    xs,
                    grad_outputs=v[j],
                    retain_graph=not (last and j == n - 1),
                    allow_unused=True,
                )
                for i, g in enumerate(one):
                    squares[i].append(_squared_norms(None if g is None else g[None], 1))
        done += n
    estimates = []
    for s in squares:
        values = torch.cat(s)
        se = float(values.std() / math.sqrt(len(values))) if len(values) > 1 else None
        estimates.append(JacobianNorm(probes, kind, mode, float(values.mean()), se))
    return estimates


def _probes(kind: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    import torch

    if kind == "gaussian":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    return torch.randint(0, 2, shape, generator=generator, dtype=torch.int8).double() * 2 - 1


def _squared_norms(g: torch.Tensor | None, n: int) -> torch.Tensor:
    import torch

    if g is None:
        return torch.zeros(n, dtype=torch.float64)
    return g.detach().reshape(n, -1).double().pow(2).sum(1)
