"""The append-only sample store: resume, interrupted writes, refusing to mix incomparable samples."""

from __future__ import annotations

import json

import pytest

from openrlhf_populora.eval.store import ResultStore

SETTINGS = {"code_template": "azr", "max_new_tokens": 64, "base_model": "/m", "members": {"s0": "aaa"}}


def sample(member: str, pid: str, passed: bool = True) -> dict:
    return {"member": member, "benchmark": "humaneval", "problem_id": pid, "passed": passed, "completion": "x"}


def test_append_and_reopen_resumes(tmp_path):
    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0"), sample("s0", "HumanEval/1", False)])
    again = ResultStore(tmp_path, SETTINGS)
    assert len(again) == 2
    assert again.has("s0", "humaneval", "HumanEval/1") and not again.has("s0", "humaneval", "HumanEval/2")
    assert {r["problem_id"]: r["passed"] for r in again.records()} == {"HumanEval/0": True, "HumanEval/1": False}


def test_samples_are_never_overwritten(tmp_path):
    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0")])
    with pytest.raises(ValueError, match="already stored"):
        store.append([sample("s0", "HumanEval/0", False)])


def test_partial_last_line_is_dropped_and_redone(tmp_path):
    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0")])
    with open(store.samples_path, "a") as handle:
        handle.write('{"member": "s0", "benchmark": "humaneval", "problem_id": "HumanEval/1", "pas')  # killed here
    with pytest.warns(UserWarning, match="partial last line"):
        again = ResultStore(tmp_path, SETTINGS)
    assert len(again) == 1 and not again.has("s0", "humaneval", "HumanEval/1")
    again.append([sample("s0", "HumanEval/1")])
    lines = again.samples_path.read_text().splitlines()
    assert [json.loads(line)["problem_id"] for line in lines] == ["HumanEval/0", "HumanEval/1"]


def test_corrupt_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0")])
    with open(store.samples_path, "a") as handle:
        handle.write("garbage\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: corrupt sample line"):
        ResultStore(tmp_path, SETTINGS)


def test_changed_settings_refuse_to_mix(tmp_path):
    ResultStore(tmp_path, SETTINGS)
    with pytest.raises(ValueError, match="setting 'max_new_tokens' was 64 .* now 128. Fix: pass a new --out"):
        ResultStore(tmp_path, {**SETTINGS, "max_new_tokens": 128})


def test_changed_adapter_refuses_but_new_members_are_added(tmp_path):
    ResultStore(tmp_path, SETTINGS)
    with pytest.raises(ValueError, match="adapter weights of member 's0' changed"):
        ResultStore(tmp_path, {**SETTINGS, "members": {"s0": "bbb"}})
    store = ResultStore(tmp_path, {**SETTINGS, "members": {"s1": "ccc"}})
    assert store.settings["members"] == {"s0": "aaa", "s1": "ccc"}


def test_a_store_graded_before_the_sanitizer_is_refused_with_the_regrade_hint(tmp_path):
    # settings.json written before code_sanitizer existed: its samples were graded whole ("none"). Catches: an
    # absent key accepted silently (samples of two graders mixed in one table); no pointer to --regrade.
    ResultStore(tmp_path, SETTINGS)
    with pytest.raises(ValueError, match="'code_sanitizer' was 'none' .* now 'definitions'.*rerun with --regrade"):
        ResultStore(tmp_path, {**SETTINGS, "code_sanitizer": "definitions"})
    # a generation setting is never regradable
    with pytest.raises(ValueError, match="'max_new_tokens' was 64") as refused:
        ResultStore(tmp_path, {**SETTINGS, "max_new_tokens": 128}, regrade=True)
    assert "--regrade" not in str(refused.value)


def test_regrade_records_the_new_settings_only_with_the_new_grades(tmp_path):
    # Catches: settings.json updated before the samples carry the new grades (an interruption in between would
    # label old grades as new), grades not written to disk, fields other than the grade changed.
    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0", False), sample("s0", "HumanEval/1", False)])
    before = store.settings_path.read_text()
    new = {**SETTINGS, "code_sanitizer": "definitions"}
    regrading = ResultStore(tmp_path, new, regrade=True)
    assert store.settings_path.read_text() == before
    regrading.replace_grades({("s0", "humaneval", "HumanEval/1"): {"passed": True, "status": "ok", "detail": ""}})
    again = ResultStore(tmp_path, new)  # no refusal now
    assert json.loads(again.settings_path.read_text())["code_sanitizer"] == "definitions"
    assert {r["problem_id"]: (r["passed"], r["completion"]) for r in again.records()} == {
        "HumanEval/0": (False, "x"), "HumanEval/1": (True, "x")}


def test_a_setting_first_given_later_is_added_and_a_changed_full_model_is_named_as_such(tmp_path):
    # full models evaluated alone store no base_model; a later invocation with the run's members adds it. A full
    # model's digest ("model:...") that changes is reported as a model, not as adapter weights. Catches: an
    # absent setting read as a conflict (no base model could ever be added), the wrong noun in the refusal.
    alone = {k: v for k, v in SETTINGS.items() if k != "base_model"} | {"members": {"b2": "model:aaa"}}
    ResultStore(tmp_path, alone)
    store = ResultStore(tmp_path, SETTINGS)
    assert store.settings["base_model"] == "/m" and store.settings["members"] == {"b2": "model:aaa", "s0": "aaa"}
    with pytest.raises(ValueError, match=r"the model \(weights, config or tokenizer\) of member 'b2' changed"):
        ResultStore(tmp_path, {**SETTINGS, "members": {"b2": "model:bbb"}})


def test_an_interrupted_regrade_is_refused_until_regraded(tmp_path, monkeypatch):
    # the process dies while samples.jsonl is being replaced: whatever the samples now hold, neither the old nor
    # the new settings may open the store, only another --regrade. Catches: no mark (a later run under the old
    # settings would accept samples carrying the new grades, or the reverse).
    import openrlhf_populora.eval.store as store_module

    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0", False)])
    new = {**SETTINGS, "code_sanitizer": "definitions"}
    real = store_module.replace_text

    def die_on_samples(path, text):
        if path.name == "samples.jsonl":
            raise KeyboardInterrupt
        real(path, text)

    monkeypatch.setattr(store_module, "replace_text", die_on_samples)
    with pytest.raises(KeyboardInterrupt):
        ResultStore(tmp_path, new, regrade=True).replace_grades(
            {("s0", "humaneval", "HumanEval/0"): {"passed": True, "status": "ok", "detail": ""}})
    monkeypatch.setattr(store_module, "replace_text", real)
    for settings in (SETTINGS, {**SETTINGS, "code_sanitizer": "none"}, new):
        with pytest.raises(ValueError, match="a --regrade was interrupted"):
            ResultStore(tmp_path, settings)
    again = ResultStore(tmp_path, new, regrade=True)
    again.replace_grades({("s0", "humaneval", "HumanEval/0"): {"passed": True, "status": "ok", "detail": ""}})
    assert ResultStore(tmp_path, new).records()[0]["passed"] is True
    assert "regrading" not in json.loads(again.settings_path.read_text())


def test_a_read_only_store_changes_nothing_on_disk(tmp_path):
    # cli.evaluate --report-only beside a running evaluation. Catches: truncating the line the writer is in the
    # middle of appending, rewriting settings.json (new members merged in), or appending.
    store = ResultStore(tmp_path, SETTINGS)
    store.append([sample("s0", "HumanEval/0")])
    with open(store.samples_path, "a") as handle:
        handle.write('{"member": "s0", "benchmark": "humaneval", "problem_id": "HumanEval/1", "pas')  # being written
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    reader = ResultStore(tmp_path, {**SETTINGS, "members": {"s0": "aaa", "s9": "new"}}, read_only=True)
    assert [r["problem_id"] for r in reader.records()] == ["HumanEval/0"]  # the partial line is skipped
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    with pytest.raises(RuntimeError, match="read-only"):
        reader.append([sample("s0", "HumanEval/2")])
    with pytest.raises(ValueError, match="setting 'max_new_tokens'"):  # still checked
        ResultStore(tmp_path, {**SETTINGS, "max_new_tokens": 128}, read_only=True)


def test_settings_recorded_later_are_taken_with_a_warning_then_enforced(tmp_path):
    # dtype, engine and device change greedy outputs. A store written before they were recorded takes the
    # current ones, saying so; from then on a different one is refused. Catches: silently mixing bf16 and fp32
    # samples in one table.
    ResultStore(tmp_path, SETTINGS)  # an old settings.json: no dtype
    with pytest.warns(UserWarning, match="does not record 'dtype'"):
        ResultStore(tmp_path, {**SETTINGS, "dtype": "bf16"})
    with pytest.raises(ValueError, match="setting 'dtype' was 'bf16'"):
        ResultStore(tmp_path, {**SETTINGS, "dtype": "fp32"})


def test_a_read_only_store_that_does_not_exist_creates_nothing(tmp_path):
    # a --report-only into a typo'd or not yet started --out. Catches: settings.json written there, pinning this
    # invocation's settings so that the real evaluation into that directory is later refused.
    reader = ResultStore(tmp_path / "eval", SETTINGS, read_only=True)
    assert reader.records() == [] and reader.settings == SETTINGS
    assert not (tmp_path / "eval").exists()
