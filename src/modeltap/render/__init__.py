"""Pure builders: tree.py (the dump tree), tables.py, run_tables.py and compare_tables.py (Rich
tables); only cli/ prints."""

from modeltap.render.compare_tables import compare_heading, compare_table
from modeltap.render.run_tables import (
    SPARKS,
    TREND_POINTS,
    run_diff_text,
    run_heading,
    run_json,
    run_table,
    sparkline,
)
from modeltap.render.tables import (
    DIFF_ROWS,
    device_bytes_table,
    diff_heading,
    diff_table,
    grads_heading,
    grads_table,
    placement_table,
)
from modeltap.render.tree import (
    DEAD_WARN,
    NEGLIGIBLE,
    WIDE,
    activation_keys,
    dump_heading,
    dump_json,
    dump_table,
    fmt,
    fmt_shape,
    grad_flag,
    grad_meta,
    module_table,
)

__all__ = [
    "DEAD_WARN",
    "DIFF_ROWS",
    "NEGLIGIBLE",
    "SPARKS",
    "TREND_POINTS",
    "WIDE",
    "activation_keys",
    "compare_heading",
    "compare_table",
    "device_bytes_table",
    "diff_heading",
    "diff_table",
    "dump_heading",
    "dump_json",
    "dump_table",
    "fmt",
    "fmt_shape",
    "grad_flag",
    "grad_meta",
    "grads_heading",
    "grads_table",
    "module_table",
    "placement_table",
    "run_diff_text",
    "run_heading",
    "run_json",
    "run_table",
    "sparkline",
]
