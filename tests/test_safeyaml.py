"""Bounded YAML reading (trainer/safeyaml.py), shared by both configs: hostile shapes are refused
after a bounded amount of work, and real configs read exactly as PyYAML reads them.

No test here times anything: work is counted (the parser's events read, the place a check
stopped at), so a loaded machine cannot fail them and a slow path cannot pass them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import safeyaml

ROOT = Path(__file__).resolve().parents[1]
LIMIT = safeyaml.MAX_NESTING


@pytest.fixture
def events_read(monkeypatch):
    """How many parser events each check asked libyaml for (the real loader, counted)."""
    counts = {"loaders": 0, "events": 0}
    real = safeyaml._Loader

    class Counting(real):
        def __init__(self, *args, **kwargs):
            counts["loaders"] += 1
            super().__init__(*args, **kwargs)

        def get_event(self):
            counts["events"] += 1
            return super().get_event()

    monkeypatch.setattr(safeyaml, "_Loader", Counting)
    return counts


def _refused(text: str) -> str:
    with pytest.raises(safeyaml.Unbounded) as caught:
        safeyaml.load(text)
    return str(caught.value)


# --- shapes caught by the prescan, before any parser --------------------------------------------

PRESCAN_SHAPES = {
    "deep flow sequences": "region: " + "[" * 200_000 + "\n",
    "deep flow mappings": "region: " + "{" * 200_000 + "\n",
    "deep flow mappings with keys": "region: " + "{a: " * 200_000 + "\n",
    "deep block mappings": "".join(" " * i + f"k{i}:\n" for i in range(10_000)),
    "deep block sequences": "".join(" " * i + "-\n" for i in range(10_000)),
    "compact sequence entries": "- " * 100_000 + "x\n",
    "flow inside block": "".join(" " * i + f"k{i}:\n" for i in range(40)) + " " * 40 + "v: " + "[" * 100 + "\n",
}


@pytest.mark.parametrize("name", PRESCAN_SHAPES)
def test_deep_nesting_is_refused_before_any_parser_reads_it(name, events_read):
    message = _refused(PRESCAN_SHAPES[name])
    assert f"nested more than {LIMIT} levels deep" in message
    assert events_read["loaders"] == 0, "a parser saw text that the prescan should have refused"


def test_the_prescan_stops_at_the_first_level_past_the_limit():
    text = "region: " + "[" * 200_000
    message = _refused(text)
    column = int(re.search(r"column (\d+)", message).group(1))
    assert column == len("region: ") + LIMIT  # the 65th bracket (1-based column), not the last one
    lines = "".join(" " * i + f"k{i}:\n" for i in range(10_000))
    assert "at line 65," in _refused(lines)


@pytest.mark.parametrize("opener, closer", [("[", "]"), ("{a: ", "}")])
def test_exactly_the_limit_is_allowed_and_one_more_is_not(opener, closer):
    deepest = "k: " + opener * (LIMIT - 1) + "x" + closer * (LIMIT - 1) + "\n"
    assert safeyaml.load(deepest) == yaml.safe_load(deepest)
    assert "nested more than" in _refused("k: " + opener * LIMIT + "x" + closer * LIMIT + "\n")


def test_block_nesting_at_the_limit_is_allowed():
    text = "".join(" " * i + f"k{i}:\n" for i in range(LIMIT - 1)) + " " * (LIMIT - 1) + "leaf: 1\n"
    assert safeyaml.load(text) == yaml.safe_load(text)
    assert "nested more than" in _refused(text.replace("leaf: 1", "leaf:\n" + " " * LIMIT + "more: 1"))


# --- shapes caught on the event stream, before any node is built --------------------------------

def _alias_chain(links: int, mapping: bool) -> str:
    if mapping:
        return "a0: &a0 {k: x}\n" + "".join(f"a{i}: &a{i} {{k: *a{i - 1}}}\n" for i in range(1, links))
    return "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, links))


def _alias_fan_out(levels: int = 25) -> str:
    text = "region: &a0 [x, x, x, x, x, x, x, x, x]\n"
    return text + "".join(f"k{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]\n" for i in range(1, levels))


@pytest.mark.parametrize("text, needle", [
    (_alias_chain(100_000, mapping=False), "aliases nest it more than"),
    (_alias_chain(100_000, mapping=True), "aliases nest it more than"),
    (_alias_fan_out(), "aliases expand to more than"),
    ("region: &a [1, *a]\n", "an alias refers to the value that contains it"),
    ("a: &a {b: [*a]}\n", "an alias refers to the value that contains it"),
], ids=["alias chain of lists", "alias chain of mappings", "alias fan-out", "self alias", "nested self alias"])
def test_aliases_are_bounded_on_the_event_stream(text, needle, events_read):
    assert needle in _refused(text)
    # The chains are 100,000 lines long; each is refused within its first few hundred events.
    assert events_read["events"] < 1000, events_read


def test_a_syntax_error_in_a_deep_text_is_still_bounded(events_read):
    # libyaml refuses the text; the better-worded pure-Python parse is bounded by the prescan.
    text = "k: " + "[" * (LIMIT - 2) + "\n  : : " + "]" * (LIMIT - 2) + "\n"
    with pytest.raises(yaml.YAMLError) as caught:
        safeyaml.load(text)
    assert safeyaml.describe(caught.value).startswith("YAML syntax error at line")


# --- real configs read exactly as PyYAML reads them ---------------------------------------------

CONFIGS = sorted([*ROOT.glob("examples/*.yaml"), *ROOT.glob("trainer/configs/*.yaml")])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_reads_as_pyyaml_reads_it(path):
    text = path.read_text(encoding="utf-8")
    assert safeyaml.load(text) == yaml.safe_load(text)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    # brackets, quotes, hashes and colons inside strings are content, not structure
    st.text(alphabet="ab[]{}'\"#:,- |>\\", max_size=12),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(alphabet="abc[]'\"# ", min_size=1, max_size=5), inner,
                                            max_size=4)),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(_VALUES, st.sampled_from([None, True, False]), st.integers(1, 6))
def test_no_false_refusals_whatever_the_style(value, flow, indent):
    text = yaml.safe_dump({"root": value}, default_flow_style=flow, indent=max(indent, 2), width=40)
    assert safeyaml.load(text) == yaml.safe_load(text)


def test_brackets_in_strings_and_scripts_are_not_levels():
    many = "[" * 500
    text = (f"quoted: '{many}'\ndouble: \"{many}\"\ncomment: 1  # {many}\n"
            f"script: |\n  echo '{many}'\n  {many}\nplain: it's {'{'}\n")
    assert safeyaml.load(text) == yaml.safe_load(text)


# --- the trainer reads through the same bounds ---------------------------------------------------

def test_a_trainer_set_value_is_bounded_and_named():
    from trainer.config import ConfigError, load_config

    # 398 bytes on one line: eight-fold aliases, nine deep (8**9 values once expanded)
    bomb = "[&a0 [x, x, x, x, x, x, x, x], " + ", ".join(
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 8)}]" for i in range(1, 9)) + "]"
    with pytest.raises(ConfigError, match=r"--set moe\.num_experts: .*aliases expand to more than"):
        load_config("tiny", ["moe.num_experts=" + bomb])
    with pytest.raises(ConfigError, match=r"--set dtype: .*nested more than"):
        load_config("tiny", ["dtype=" + "[" * 100_000])


def test_a_trainer_config_file_is_bounded_and_named(tmp_path):
    from trainer.config import ConfigError, load_config

    path = tmp_path / "deep.yaml"
    path.write_text("base: tiny\nmodel:\n" + "".join(" " * i + f"k{i}:\n" for i in range(2, 10_000)))
    with pytest.raises(ConfigError, match=rf"config {re.escape(str(path))} is not a config: nested more than"):
        load_config(str(path))
