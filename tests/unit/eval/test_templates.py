"""Which prompt template an evaluation uses: ``auto`` resolved from the base model's tokenizer and from how the
evaluated runs were trained, printed, recorded in settings.json, and refused when the sources disagree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from openrlhf_populora.cli.evaluate import main
from openrlhf_populora.eval.prompts import (
    CHAT_TEMPLATES,
    RAW_TEMPLATES,
    choose_templates,
    model_has_chat_template,
    resolve_templates,
)
from openrlhf_populora.eval.store import ResultStore

AUTO = {"code": "auto", "math": "auto"}


# ------------------------------------------------------------------------------------ choose_templates


def test_a_run_trained_on_raw_prompts_gets_azr_even_on_a_chat_model():
    # catches: deciding from the tokenizer alone (an instruct base model would then force chat on AZR adapters)
    templates, why = choose_templates(True, {"--run r": False})
    assert templates == RAW_TEMPLATES == {"code": "azr", "math": "azr_boxed"}
    assert "--run r" in why and "chat_template: false" in why


def test_a_tokenizer_without_chat_template_gets_azr():
    # catches: always answering chat (rendering would then fail, or a base model be prompted wrongly)
    assert choose_templates(False, {})[0] == RAW_TEMPLATES
    assert choose_templates(False, {"--run r": True, "--adapter a": None})[0] == RAW_TEMPLATES
    assert "no chat template" in choose_templates(False, {})[1]


def test_an_instruct_model_and_chat_trained_runs_get_chat():
    # catches: the old fixed default azr, which cost Qwen2.5-Coder-0.5B-Instruct most of its HumanEval score
    assert choose_templates(True, {})[0] == CHAT_TEMPLATES == {"code": "chat", "math": "chat"}
    templates, why = choose_templates(True, {"--run r": True, "--adapter a": None})
    assert templates == CHAT_TEMPLATES
    assert "--run r trained with it" in why
    assert "--adapter a" in why and "not recorded" in why  # an unknown source is named, with the way out


def test_sources_trained_on_different_formats_are_refused():
    # catches: letting one source silently win, which evaluates the other in a format it never saw
    with pytest.raises(ValueError, match="--run a trained on raw prompts.*--baseline b with the chat template"):
        choose_templates(True, {"--run a": False, "--baseline b": True})


# ----------------------------------------------------------------------------------- resolve_templates


def test_explicit_templates_are_kept_and_only_auto_is_resolved():
    # catches: auto overriding a template the user named
    templates, why = resolve_templates({"code": "completion", "math": "auto"}, True, {})
    assert templates == {"code": "completion", "math": "chat"}
    assert "math: auto" in why and "code: as given" in why
    # sources that disagree need no resolution when both kinds are named
    assert resolve_templates({"code": "azr", "math": "azr_boxed"}, True, {"a": False, "b": True})[0] == RAW_TEMPLATES
    with pytest.raises(ValueError, match="one prompt template cannot fit both"):
        resolve_templates({"code": "azr", "math": "auto"}, True, {"a": False, "b": True})


def test_chat_without_a_chat_template_is_refused_early():
    # catches: accepting --code-template chat on a tokenizer without one (it failed only at the first batch)
    with pytest.raises(ValueError, match="needs the base model's chat template"):
        resolve_templates({"code": "chat", "math": "azr_boxed"}, False, {})
    with pytest.raises(ValueError, match="unknown|choose one of"):
        resolve_templates({"code": "nope", "math": "auto"}, True, {})


# ---------------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from openrlhf_populora.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="module")
def plain_model_dir(tmp_path_factory, model_dir) -> str:
    """The tiny model with its chat template removed (a base model that was never chat-tuned)."""
    target = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(model_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return str(target)


def fake_run(root: Path, model_dir: str, chat_template: bool | None, ids=("s0",)) -> Path:
    """A run directory whose config.yaml records populora.chat_template (left out when None)."""
    root.mkdir(parents=True)
    config: dict = {"actor": {"model_name_or_path": model_dir}}
    if chat_template is not None:
        config["populora"] = {"chat_template": chat_template}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    for member_id in ids:
        adapter = root / "adapters" / member_id
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text(json.dumps(
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "base_model_name_or_path": model_dir}))
        (adapter / "adapter_model.safetensors").write_bytes(member_id.encode())
    return root


def recorded(out: Path) -> tuple[str, str]:
    """The templates the store is (or would be) opened with: results.json's settings (a --report-only run
    writes no settings.json)."""
    settings = json.loads((out / "results.json").read_text())["settings"]
    return settings["code_template"], settings["math_template"]


def evaluate(*argv: str) -> int:
    """The command line without generation (``--report-only``): templates resolved, nothing written but the
    report (results.json holds the settings)."""
    return main([*argv, "--base", "--limit", "1", "--report-only"])


@pytest.mark.parametrize(("chat_template", "expected"), [(False, ("azr", "azr_boxed")), (True, ("chat", "chat")),
                                                         (None, ("chat", "chat"))])
def test_the_run_config_decides_and_settings_record_the_resolved_names(tmp_path, model_dir, capsys,
                                                                       chat_template, expected):
    # catches: not reading populora.chat_template from config.yaml, and recording 'auto' in settings.json
    # (two invocations that resolved differently would then share samples)
    run = fake_run(tmp_path / "run", model_dir, chat_template)
    assert evaluate("--run", str(run)) == 0
    assert recorded(run / "eval") == expected
    printed = capsys.readouterr().out
    assert f"prompt templates: code {expected[0]}, math {expected[1]}" in printed
    if chat_template is False:
        assert "populora.chat_template: false" in printed  # the reason is printed


def test_a_base_model_without_chat_template_resolves_to_azr(tmp_path, plain_model_dir, capsys):
    # catches: not asking the base model's tokenizer (chat would be chosen for a model that cannot render it)
    assert model_has_chat_template(plain_model_dir) is False
    assert evaluate("--base-model", plain_model_dir, "--out", str(tmp_path / "out")) == 0
    assert recorded(tmp_path / "out") == ("azr", "azr_boxed")
    assert "has no chat template" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        evaluate("--base-model", plain_model_dir, "--out", str(tmp_path / "other"), "--code-template", "chat")
    assert exc.value.code == 2 and "needs the base model's chat template" in capsys.readouterr().err


def test_a_baseline_trained_otherwise_than_the_run_exits_2(tmp_path, model_dir, capsys):
    # catches: ignoring the --baseline run's format (it would be evaluated in the run's)
    run = fake_run(tmp_path / "run", model_dir, False)
    baseline = fake_run(tmp_path / "baseline", model_dir, True, ids=("b0",))
    with pytest.raises(SystemExit) as exc:
        evaluate("--run", str(run), "--baseline", str(baseline))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "one prompt template cannot fit both" in err and f"--baseline {baseline}" in err
    assert not (run / "eval" / "settings.json").exists()  # refused before anything was written
    # naming both templates is the documented way to evaluate them together anyway
    assert evaluate("--run", str(run), "--baseline", str(baseline), "--code-template", "azr",
                    "--math-template", "azr_boxed") == 0


def test_a_bare_adapter_beside_a_raw_run_follows_the_run(tmp_path, model_dir, capsys):
    run = fake_run(tmp_path / "run", model_dir, False)
    other = fake_run(tmp_path / "other", model_dir, None, ids=("x",))
    assert evaluate("--run", str(run), "--adapter", f"mine={other / 'adapters' / 'x'}") == 0
    assert recorded(run / "eval") == ("azr", "azr_boxed")


def test_resuming_with_a_different_resolution_is_refused(tmp_path, model_dir, capsys):
    # catches: a resolution that is not part of the samples' identity (chat and azr samples would mix)
    run = fake_run(tmp_path / "run", model_dir, True)
    assert evaluate("--run", str(run)) == 0
    assert recorded(run / "eval") == ("chat", "chat")
    ResultStore(run / "eval", json.loads((run / "eval" / "results.json").read_text())["settings"])  # a store
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["populora"]["chat_template"] = False  # the same --out, now resolving to azr
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exc:
        evaluate("--run", str(run))
    assert exc.value.code == 2 and "setting 'code_template' was 'chat'" in capsys.readouterr().err


def test_a_malformed_chat_template_setting_is_an_error(tmp_path, model_dir, capsys):
    run = fake_run(tmp_path / "run", model_dir, None)
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": model_dir},
                                                     "populora": {"chat_template": "yes"}}))
    with pytest.raises(SystemExit) as exc:
        evaluate("--run", str(run))
    assert exc.value.code == 2 and "populora.chat_template must be true or false" in capsys.readouterr().err
