"""durable.replace_file: the old file or the new one, never a torn one, and nothing named before it is on disk."""

import os
from pathlib import Path

import pytest
from fs_events import record_fsync_and_replace

from openrlhf_populora.durable import replace_file, replace_text
from openrlhf_populora.metrics.tracker import Tracker


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    # Catches: writing the target in place (a half-written file where the old one was), or a temporary file left
    # beside it after the failure.
    target = tmp_path / "state.json"
    target.write_text("old")

    def half_then_fail(path: Path) -> None:
        path.write_text("ne")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_file(target, half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_the_new_bytes_are_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    # Catches: no fsync of the file before the rename (after a power loss, ext4 may hold the rename and an empty
    # file), or none of the directory after it (the rename itself may be lost).
    events = record_fsync_and_replace(monkeypatch)
    replace_text(tmp_path / "latest", "step_000003")
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"]
    assert Path(events[0][1]).name.startswith(".latest.") and events[1][1] == str(tmp_path / "latest")
    assert events[2][1] == str(tmp_path)
    assert (tmp_path / "latest").read_text() == "step_000003"


def test_run_meta_is_written_durably(tmp_path, monkeypatch):
    # run_meta.json's sessions are the run's provenance. Catches: Tracker writing it with a bare rename, no fsync.
    events = record_fsync_and_replace(monkeypatch)
    with Tracker(tmp_path, meta={"label": "pop", "mode": "population"}):
        pass
    meta = str(tmp_path / "run_meta.json")
    at = [i for i, event in enumerate(events) if event == ("replace", meta)]
    assert at and all(events[i - 1][0] == "fsync" and ".run_meta.json." in events[i - 1][1] for i in at)
    assert all(events[i + 1] == ("fsync", str(tmp_path)) for i in at)


def test_the_file_gets_the_usual_permissions_and_a_killed_writers_leftover_is_reused(tmp_path):
    # Catches: a private temporary file (mkstemp's 0600) renamed into place, making config.yaml, run_meta.json
    # or the eval store owner-only on a shared machine; and leftovers of a killed writer piling up.
    old = os.umask(0o022)
    try:
        (tmp_path / ".run_meta.json.tmp").write_text("half a file from a killed writer")
        replace_text(tmp_path / "run_meta.json", "{}")
        assert (tmp_path / "run_meta.json").stat().st_mode & 0o777 == 0o644
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run_meta.json"]
    finally:
        os.umask(old)


def test_a_tree_is_fsynced_file_by_file_and_each_directory_after_its_contents(tmp_path, monkeypatch):
    # fsync_tree (a saved checkpoint directory): every regular file, then its directory, deepest directory first,
    # the tree's root last; a symlink is not followed (what it points to is not part of the tree). Catches: a
    # directory synced before its files or its subdirectories, a file or directory skipped, a symlink's target
    # synced instead, the walk's root or order changed.
    from openrlhf_populora.durable import fsync_tree

    root = tmp_path / "ckpt"
    (root / "adapters" / "t0").mkdir(parents=True)
    (root / "adapters" / "t0" / "adapter.safetensors").write_bytes(b"w")
    (root / "state.json").write_text("{}")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    (root / "link").symlink_to(outside)
    events = record_fsync_and_replace(monkeypatch)
    fsync_tree(root)
    assert events == [("fsync", str(root / "adapters" / "t0" / "adapter.safetensors")),
                      ("fsync", str(root / "adapters" / "t0")), ("fsync", str(root / "adapters")),
                      ("fsync", str(root / "state.json")), ("fsync", str(root))]
