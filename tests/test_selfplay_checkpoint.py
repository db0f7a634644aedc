import pytest

from openrlhf_populora.selfplay.checkpoint import checkpoint_step, latest_checkpoint, save_checkpoint


def _writer(text):
    def write(directory):
        (directory / "state.txt").write_text(text)

    return write


def test_latest_and_pruning(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _writer(f"s{step}"), max_num=2)
    latest = latest_checkpoint(tmp_path)
    assert checkpoint_step(latest) == 4 and (latest / "state.txt").read_text() == "s4"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]


def test_crash_while_saving_keeps_last_good(tmp_path):
    save_checkpoint(tmp_path, 1, _writer("good"))

    def crash(directory):
        (directory / "state.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, crash)
    latest = latest_checkpoint(tmp_path)
    assert checkpoint_step(latest) == 1 and (latest / "state.txt").read_text() == "good"
    # a later save of the same step still works and replaces the partial directory
    save_checkpoint(tmp_path, 2, _writer("again"))
    assert (latest_checkpoint(tmp_path) / "state.txt").read_text() == "again"


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, _writer("first"))
    save_checkpoint(tmp_path, 5, _writer("second"))
    assert (latest_checkpoint(tmp_path) / "state.txt").read_text() == "second"


def test_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
