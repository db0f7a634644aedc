"""Record, in order, every ``os.fsync`` (the path it synced) and ``os.replace`` (its destination): how the
durable-write tests see that bytes reach the disk before a rename names them."""

import os


def record_fsync_and_replace(monkeypatch) -> list[tuple[str, str]]:
    """``("fsync", path)`` and ``("replace", destination)`` events, appended as they happen (the real calls still
    run)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    return events
