"""`modeltap ls`: the module tree, without loading weights."""

from __future__ import annotations

from modeltap.cli.app import app, handle_errors, settings, stdout
from modeltap.cli.options import (
    AllowPickleOpt,
    ConfigOpt,
    DepthOpt,
    ExcludeOpt,
    IncludeOpt,
    ModelArg,
    ModelClassOpt,
    RevisionOpt,
    TrustOpt,
)
from modeltap.errors import InputError


@app.command("ls")
@handle_errors
def list_modules(
    model: ModelArg = None,
    depth: DepthOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    trust_remote_code: TrustOpt = None,
    allow_pickle: AllowPickleOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List a model's modules as a tree, without loading weights or running it."""
    s = settings(
        "ls",
        config,
        model=model,
        depth=depth,
        include=include or [],
        exclude=exclude or [],
        revision=revision,
        model_class=model_class,
        trust_remote_code=trust_remote_code,
    )
    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    from modeltap.cli.dump import _is_transformed, _module_tree
    from modeltap.loading import load_meta_model
    from modeltap.render import module_table
    from modeltap.selection import Selection, select_modules

    if _is_transformed(s.model):
        meta_model = _module_tree(s.model, bool(allow_pickle))
    else:
        meta_model, _ = load_meta_model(
            s.model,
            revision=s.revision,
            model_class_name=s.model_class,
            trust_remote_code=s.trust_remote_code,
        )
    names = select_modules(meta_model, Selection(s.depth, tuple(s.include), tuple(s.exclude)))
    stdout().print(module_table(meta_model, names))
