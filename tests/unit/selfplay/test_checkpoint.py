"""Atomic, durable checkpoints: published only complete and fsynced, the previous one kept until then."""

import os
from pathlib import Path

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


def _nested_writer(text):
    def write(directory):
        (directory / "engine").mkdir()
        (directory / "engine" / "engine_state.pt").write_text(text)
        (directory / "state.txt").write_text(text)

    return write


def _recording_fsync(monkeypatch, root, events, fail_at=None):
    """Wrap os.fsync: record (what was fsynced, relative to root, and which checkpoints exist at that moment);
    raise OSError (a power loss) at call number ``fail_at``."""
    real = os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if fail_at is not None and len(events) == fail_at:
            raise OSError("power lost (simulated)")
        events.append((str(path.relative_to(root)) if path != root else ".",
                       sorted(p.name for p in root.glob("step_*"))))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_every_file_and_directory_is_fsynced_before_it_is_published(tmp_path, monkeypatch):
    """Catches: no fsync (a power loss after the rename leaves a checkpoint whose data never reached the disk)."""
    events = []
    _recording_fsync(monkeypatch, tmp_path, events)
    save_checkpoint(tmp_path, 1, _nested_writer("one"))
    synced = [name for name, _ in events]
    partial = ".step_000001.partial"
    for name in ("engine/engine_state.pt", "state.txt", "COMPLETE", "engine", ""):  # the files, then directories
        assert str(Path(partial) / name) in synced or (name == "" and partial in synced), name
    # all of that before the rename that publishes it, then the root (the rename) and the pointer
    first_root = synced.index(".")
    assert all(name.startswith(partial) for name in synced[:first_root])
    assert any(name.startswith(".latest.") for name in synced[first_root:]) and synced[-1] == "."


@pytest.mark.parametrize("crash_at", range(9))
def test_a_power_loss_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, crash_at):
    """Catches: pruning the previous checkpoint before the new one is durable (a crash at any fsync of the new
    save must leave the old one on disk, and latest_checkpoint must name a complete one)."""
    save_checkpoint(tmp_path, 1, _nested_writer("one"), max_num=1)
    events = []
    _recording_fsync(monkeypatch, tmp_path, events, fail_at=crash_at)
    try:
        save_checkpoint(tmp_path, 2, _nested_writer("two"), max_num=1)
        crashed = False
    except OSError:
        crashed = True
    latest = latest_checkpoint(tmp_path)
    if crashed:
        assert (tmp_path / "step_000001" / "state.txt").read_text() == "one"
        assert checkpoint_step(latest) in (1, 2)
    else:  # more fsync calls than crash_at: the save finished, and only then pruned
        assert checkpoint_step(latest) == 2 and not (tmp_path / "step_000001").exists()
    if crash_at == 0:
        assert crashed  # the range covers the whole sequence
    # every fsync of the save happened while the previous checkpoint was still there
    assert all("step_000001" in existing for _, existing in events)


def test_a_crash_while_re_saving_a_step_falls_back_to_its_previous_copy(tmp_path, monkeypatch):
    """Catches: losing a step's only checkpoint between moving it aside and publishing its replacement."""
    save_checkpoint(tmp_path, 5, _writer("first"))
    real_replace = os.replace

    def crash_on_publish(src, dst):
        if str(src).endswith(".step_000005.partial"):
            raise OSError("crash between the two renames (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_publish)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 5, _writer("second"))
    latest = latest_checkpoint(tmp_path)
    assert checkpoint_step(latest) == 5 and (latest / "state.txt").read_text() == "first"


def test_keep_every_keeps_the_snapshots_beyond_max_num(tmp_path):
    """Catches: pruning the every-N-th snapshots cli.retention reads (signature presets checkpoint every step)."""
    for step in range(0, 24):
        save_checkpoint(tmp_path, step, _writer(f"s{step}"), max_num=3, keep_every=10)
    assert sorted(checkpoint_step(p) for p in tmp_path.glob("step_*")) == [0, 10, 20, 21, 22, 23]
    assert not list(tmp_path.glob(".step_*"))


def test_the_engine_state_is_fsynced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """Catches: engines/local/state.py writing engine_state.pt without fsync (file, then directory)."""
    from fs_events import record_fsync_and_replace

    from openrlhf_populora.engines.local.state import read_state, write_state

    events = record_fsync_and_replace(monkeypatch)
    write_state(tmp_path, {"x": 1}, {"c": 2})
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"]
    assert ".engine_state." in events[0][1] and events[1][1].endswith("engine_state.pt")
    assert events[2][1] == str(tmp_path)
    assert read_state(tmp_path) == {"x": 1}
