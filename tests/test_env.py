"""GOCKPT_* environment variables (gockpt.env): parsing, errors naming the variable, typos."""

from __future__ import annotations

import logging

import pytest

from gockpt import GoCkptConfig, env


@pytest.mark.parametrize(("raw", "kind", "want"), [
    (" yes ", bool, True), ("OFF", bool, False), ("4_194_304", int, 4 << 20), ("2.5e9", float, 2.5e9),
    (" lazy ", str, "lazy"),
])
def test_values_parse(raw, kind, want):
    assert env.parse_env_value(raw, kind, "GOCKPT_X") == want


@pytest.mark.parametrize(("raw", "kind"), [("perhaps", bool), ("many", int), ("fast", float)])
def test_unparsable_values_name_the_variable(raw, kind):
    with pytest.raises(ValueError, match=f"GOCKPT_X={raw!r}"):
        env.parse_env_value(raw, kind, "GOCKPT_X")


def test_range_errors_get_the_variable_in_front():
    with pytest.raises(ValueError) as caught:
        GoCkptConfig(mode="fastest")
    named = env.name_source(caught.value, {"mode": "GOCKPT_MODE='fastest'"})
    assert str(named).startswith("GOCKPT_MODE='fastest': mode must be one of")
    other = env.name_source(caught.value, {"max_inflight": "GOCKPT_MAX_INFLIGHT='3'"})
    assert other is caught.value  # a field the message does not name is left alone


def test_misspelled_variables_are_logged_once_with_a_suggestion(caplog):
    caplog.set_level(logging.WARNING, logger="gockpt.env")
    known = [env.env_name("mode"), env.env_name("max_inflight"), env.CONFIG_FILE_ENV]
    environ = {"GOCKPT_MOD": "sync", "GOCKPT_MAX_INFLIGT": "3", "GOCKPT_MODE": "lazy",
               "GOCKPT_ZZZ_TEST_ONLY": "1", "PATH": "/bin"}
    for _ in range(2):
        unknown = env.warn_unknown(known, environ)
    assert unknown == ["GOCKPT_MAX_INFLIGT", "GOCKPT_MOD", "GOCKPT_ZZZ_TEST_ONLY"]
    messages = [r.getMessage() for r in caplog.records if r.name == "gockpt.env"]
    assert len(messages) == 3  # once per name, however often the environment is read
    assert any("GOCKPT_MOD is not a GoCkpt option" in m and "did you mean GOCKPT_MODE?" in m
               for m in messages)
    assert any("did you mean GOCKPT_MAX_INFLIGHT?" in m for m in messages)


def test_accelerate_plugin_names_the_variable(monkeypatch, caplog):
    pytest.importorskip("accelerate")
    from accelerate_gockpt import GoCkptPlugin

    monkeypatch.setenv("GOCKPT_MODE", "fastest")
    with pytest.raises(ValueError, match=r"^GOCKPT_MODE='fastest': mode must be one of"):
        GoCkptPlugin()
    monkeypatch.setenv("GOCKPT_MODE", "lazy")
    monkeypatch.setenv("GOCKPT_MIN_OVERLAP_STEPS", "9")
    with pytest.raises(ValueError, match=r"^GOCKPT_MIN_OVERLAP_STEPS='9': min_overlap_steps"):
        GoCkptPlugin()
    monkeypatch.delenv("GOCKPT_MIN_OVERLAP_STEPS")
    caplog.set_level(logging.WARNING, logger="gockpt.env")
    monkeypatch.setenv("GOCKPT_MAX_INFLIGHTS_TEST_ONLY", "4")
    assert GoCkptPlugin().mode == "lazy"
    assert any("GOCKPT_MAX_INFLIGHTS_TEST_ONLY" in r.getMessage() for r in caplog.records)
