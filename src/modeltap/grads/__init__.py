"""`modeltap grads` as a package: spec.py (what to differentiate: GradSpec, the output gradient),
backward.py (one forward and one backward, streaming gradients to the dump), losses.py (--loss
lm/mlm), jacobian.py (Hutchinson norm estimates), verb.py (`grads`: the verb from Python).

This package is also the verb: `modeltap.grads(model, inputs, path)` calls `verb.grads`
(`_lazy.callable_package`)."""

from modeltap._lazy import callable_package
from modeltap.grads.backward import GradRun, run_grads
from modeltap.grads.jacobian import JacobianNorm, jacobian_norms
from modeltap.grads.spec import LOSSES, PROBES, GradSpec, parse_grad_output, seed_tensor

__all__ = [
    "LOSSES",
    "PROBES",
    "GradRun",
    "GradSpec",
    "JacobianNorm",
    "jacobian_norms",
    "parse_grad_output",
    "run_grads",
    "seed_tensor",
]

callable_package(__name__, "modeltap.grads.verb", "grads")
