"""`modeltap ls`: the module tree, without loading weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap.cli.app import app, handle_errors, refuse, stdout
from modeltap.cli.checks import refuse_pickle_flag
from modeltap.cli.options import SELECT, Given, command
from modeltap.config.declare import CliOption
from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.config import Settings

NO_CACHE = CliOption(
    ("--no-cache",),
    help="Build the tree with torch and transformers instead of reading it from the cache of "
    "earlier runs ($MODELTAP_CACHE, else $XDG_CACHE_HOME/modeltap or ~/.cache/modeltap), and "
    "leave the cache as it is.",
    type=bool,
    default=False,
)


@app.command("ls")
@handle_errors
@command(
    "ls",
    "model",
    *SELECT,
    "revision",
    "model_class",
    "trust_remote_code",
    "device_map",
    "max_memory",
    "dtype",
    "allow_pickle",
    "config",
    ("no_cache", NO_CACHE),
)
def list_modules(s: Settings, given: Given, *, allow_pickle: bool | None, no_cache: bool) -> None:
    """List a model's modules as a tree, and where --device-map would put them; loads no
    weights of a Hugging Face model."""
    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    from modeltap.loading.placement import placement
    from modeltap.loading.transformed import is_transformed, transformed_tree
    from modeltap.selection import Selection, select_modules

    refuse_pickle_flag(s.model, allow_pickle)
    planned = placement(s.device_map, s.max_memory)
    if planned is None:
        refuse(
            given.flags("dtype"),
            "can't apply without --device-map (it sizes the weights to place)",
            "add --device-map auto or drop {flags}",
        )
    if planned is None and not is_transformed(s.model):
        # a Hugging Face model's tree comes from the cache when an earlier run stored it
        from modeltap.loading.tree_cache import module_tree
        from modeltap.render import module_table
        from modeltap.selection import select_names

        modules = module_tree(
            s.model,
            revision=s.revision,
            model_class_name=s.model_class,
            trust_remote_code=s.trust_remote_code,
            use_cache=not no_cache,
        )
        names = select_names(
            [m.name for m in modules], Selection(s.depth, tuple(s.include), tuple(s.exclude))
        )
        stdout().print(module_table(modules, names))
        return
    if is_transformed(s.model):
        if planned is not None:
            raise InputError("--device-map is for Hugging Face models; an archive loads on the CPU")
        refuse(
            given.flags("revision", "model_class", "trust_remote_code"),
            f"can't apply to '{s.model}', an archive or a factory (they load Hugging Face models)",
        )
        meta_model = transformed_tree(s.model, bool(allow_pickle))
    else:
        from modeltap.loading import load_meta_model

        meta_model, _ = load_meta_model(
            s.model,
            revision=s.revision,
            model_class_name=s.model_class,
            trust_remote_code=s.trust_remote_code,
            dtype=s.dtype if planned is not None else None,
        )
    names = select_modules(meta_model, Selection(s.depth, tuple(s.include), tuple(s.exclude)))
    out = stdout()
    if planned is None:
        from modeltap.render import module_table

        out.print(module_table(meta_model, names))
        return
    from modeltap.loading.placement import bytes_per_device, module_bytes, module_devices, plan
    from modeltap.render import device_bytes_table, placement_table

    device_map = plan(meta_model, planned)
    devices = module_devices(device_map, names)
    out.print(placement_table(meta_model, names, devices, module_bytes(meta_model, names)))
    out.print()
    out.print(device_bytes_table(bytes_per_device(meta_model, device_map)))
