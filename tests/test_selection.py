import pytest

from modeltap.errors import SelectionError
from modeltap.selection import ROOT, Selection, module_depth, select_names

NAMES = [
    "",
    "embeddings",
    "embeddings.word_embeddings",
    "encoder",
    "encoder.layer",
    "encoder.layer.0",
    "encoder.layer.0.output",
    "encoder.layer.0.output.dense",
    "encoder.layer.9",
    "encoder.layer.9.output",
    "encoder.layer.9.output.dense",
]


def test_depth_counts_dotted_parts():
    assert [
        module_depth(n) for n in ("", "encoder", "encoder.layer.9", "encoder.layer.9.output")
    ] == [
        0,
        1,
        3,
        4,
    ]
    assert select_names(NAMES, Selection(depth=0)) == [ROOT]
    assert select_names(NAMES, Selection(depth=1)) == [ROOT, "embeddings", "encoder"]


def test_everything_by_default_with_root_named():
    assert select_names(NAMES, Selection()) == [ROOT, *NAMES[1:]]


def test_include_exclude_globs():
    picked = select_names(NAMES, Selection(include=("encoder.layer.9.*",)))
    assert picked == ["encoder.layer.9.output", "encoder.layer.9.output.dense"]
    picked = select_names(NAMES, Selection(include=("encoder.*",), exclude=("*.dense",)))
    assert picked == [
        "encoder.layer",
        "encoder.layer.0",
        "encoder.layer.0.output",
        "encoder.layer.9",
        "encoder.layer.9.output",
    ]
    assert select_names(NAMES, Selection(depth=3, include=("encoder.*",))) == [
        "encoder.layer",
        "encoder.layer.0",
        "encoder.layer.9",
    ]


def test_unknown_exact_name_suggests():
    with pytest.raises(SelectionError, match="did you mean 'encoder.layer.9'"):
        select_names(NAMES, Selection(include=("encoder.layr.9",)))


def test_glob_matching_nothing_says_so():
    with pytest.raises(SelectionError, match="'decoder.*' matches no module"):
        select_names(NAMES, Selection(include=("decoder.*",)))


def test_combination_keeping_nothing_is_an_error():
    with pytest.raises(SelectionError, match="keeps no module"):
        select_names(NAMES, Selection(depth=1, include=("encoder.layer.*",)))
    with pytest.raises(SelectionError, match="--depth must be 0 or more"):
        select_names(NAMES, Selection(depth=-1))
