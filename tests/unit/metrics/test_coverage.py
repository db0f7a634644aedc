"""CVT coverage archive: reproducible centroids, growth only on new kinds of programs, persistence."""

import numpy as np
import pytest

from openrlhf_populora.metrics import coverage
from openrlhf_populora.metrics.coverage import (
    DESCRIPTORS,
    CoverageArchive,
    centroids_for,
    program_descriptor,
    program_fingerprint,
)

CELLS = 256  # small archives keep the tests fast; the default (4096) is checked once below


def program(level: int) -> str:
    body = "".join(f"    if x > {i}:\n        x = x - {i + 1}\n" for i in range(level))
    return f"def f(x):\n{body}    return x\n"


@pytest.fixture(scope="module")
def centroids():
    return centroids_for(CELLS, seed=0, cache=False)


@pytest.mark.slow
def test_same_seed_gives_identical_centroids():
    a = centroids_for(CELLS, seed=3, cache=False)
    b = centroids_for(CELLS, seed=3, cache=False)
    c = centroids_for(CELLS, seed=4, cache=False)
    assert a.shape == (CELLS, len(DESCRIPTORS))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() <= 1


def test_two_runs_with_the_same_seed_share_centroids(tmp_path, monkeypatch):
    monkeypatch.setenv("POPULORA_CACHE_DIR", str(tmp_path / "cache"))
    one = CoverageArchive.create(tmp_path / "run1", seed=0, cells=CELLS)
    two = CoverageArchive.create(tmp_path / "run2", seed=0, cells=CELLS)
    assert np.array_equal(np.load(tmp_path / "run1" / "centroids.npy"), np.load(tmp_path / "run2" / "centroids.npy"))
    assert one.cells == two.cells == CELLS


def test_coverage_grows_with_new_kinds_of_programs_only(centroids):
    archive = CoverageArchive(centroids)
    first = archive.add([program(0)], teacher="t0")
    assert first["new_cells"] == 1 and first["new_programs"] == 1
    covered = archive.coverage()
    assert covered == pytest.approx(1 / CELLS)
    for _ in range(5):  # the same program again (also reformatted) changes nothing but the visit count
        again = archive.add([program(0), program(0).replace("    ", "  ") + "# comment\n"], teacher="t0")
        assert again["new_cells"] == 0 and again["new_programs"] == 0
    assert archive.coverage() == covered
    assert archive.distinct_programs() == 1
    assert archive.num_programs == 11
    new_kinds = [{"program": program(level), "inputs": ["7" * 4 ** (level % 5)], "outputs": ["1" * 3 ** level]}
                 for level in range(1, 12)]
    grown = archive.add(new_kinds, teacher="t1")
    assert grown["new_programs"] == 11
    assert grown["new_cells"] >= 4
    assert archive.coverage() > covered


def test_per_teacher_coverage_and_diversity(centroids):
    archive = CoverageArchive(centroids)
    assert archive.diversity() == 0.0 and archive.coverage() == 0.0
    archive.add([program(0)] * 4, teacher="t0")
    assert archive.diversity() == pytest.approx(1.0)  # everything in one cell
    archive.add([program(level) for level in (2, 6, 12)], teacher=["t1", "t1", None])
    assert archive.coverage("t0") == pytest.approx(1 / CELLS)
    assert archive.coverage("t1") > 0
    assert archive.coverage("nobody") == 0.0
    assert archive.distinct_programs("t0") == 1
    assert archive.diversity() > 1.0
    metrics = archive.metrics()
    assert metrics["coverage/overall"] == archive.coverage()
    assert metrics["member/t0/teacher/all/coverage"] == archive.coverage("t0")
    assert metrics["coverage/new_cells"] == archive.archive.stats.num_elites
    assert archive.metrics()["coverage/new_cells"] == 0  # counted since the previous call


def test_io_descriptors_separate_equal_programs():
    code = program(1)
    small = program_descriptor(code, inputs=["1"], outputs=["2"])
    large = program_descriptor(code, inputs=["[" + ", ".join(map(str, range(200))) + "]"], outputs=["2"])
    assert small.shape == (len(DESCRIPTORS),)
    assert large[4] > small[4] and np.array_equal(large[:4], small[:4])
    assert program_descriptor("def f(:") is None


def test_accepts_dicts_task_like_objects_and_arrays(centroids):
    class TaskLike:
        program = program(3)
        inputs = ["5"]
        outputs = ["2"]

    archive = CoverageArchive(centroids)
    result = archive.add([{"program": program(2), "inputs": ["1"]}, {"code": program(4)}, TaskLike(), "def f(:"])
    assert result["added"] == 3 and result["skipped"] == 1
    array_result = archive.add(np.full((2, len(DESCRIPTORS)), 0.5), teacher="t9")
    assert array_result["added"] == 2 and array_result["new_programs"] == 0
    assert archive.coverage("t9") > 0


def test_bad_input_is_a_clear_error(centroids):
    archive = CoverageArchive(centroids)
    with pytest.raises(ValueError, match="teachers"):
        archive.add([program(1), program(2)], teacher=["t0"])
    with pytest.raises(ValueError, match="shape"):
        archive.add(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="within"):
        archive.add(np.full((1, len(DESCRIPTORS)), 2.0))
    with pytest.raises(TypeError, match="program"):
        archive.add([42])
    with pytest.raises(ValueError, match="centroids"):
        CoverageArchive(np.zeros((10, 2)))


def test_save_and_load_round_trip(tmp_path, centroids):
    archive = CoverageArchive(centroids, seed=0)
    archive.add([program(level) for level in range(8)], teacher="t0")
    archive.add([program(20)], teacher="t1")
    archive.save(tmp_path / "archive")
    loaded = CoverageArchive.load(tmp_path / "archive")
    assert np.array_equal(loaded.centroids, archive.centroids)
    assert loaded.coverage() == archive.coverage()
    assert loaded.coverage_by_teacher() == archive.coverage_by_teacher()
    assert loaded.distinct_programs() == archive.distinct_programs()
    assert loaded.diversity() == pytest.approx(archive.diversity())
    assert loaded.num_programs == archive.num_programs
    again = loaded.add([program(3)], teacher="t0")  # already known after the reload
    assert again["new_cells"] == 0 and again["new_programs"] == 0
    with pytest.raises(FileNotFoundError):
        CoverageArchive.load(tmp_path / "nowhere")


def test_create_reuses_the_centroids_of_the_run(tmp_path):
    custom = centroids_for(CELLS, seed=11, cache=False)
    np.save(tmp_path / "centroids.npy", custom)
    archive = CoverageArchive.create(tmp_path, seed=0)
    assert np.array_equal(archive.centroids, custom)


def test_fingerprint_ignores_formatting():
    assert program_fingerprint("def f(x):\n    return x\n") == program_fingerprint("def f(x):  return x # hi")
    assert program_fingerprint("def f(x): return x") != program_fingerprint("def f(y): return y")


@pytest.mark.slow
def test_default_archive_has_4096_cells(tmp_path, monkeypatch):
    monkeypatch.setenv("POPULORA_CACHE_DIR", str(tmp_path / "cache"))
    # an earlier test in this process may have computed these cells: start from a cold process cache,
    # so that the disk file is written here
    monkeypatch.setattr(coverage, "_CENTROID_CACHE", {})
    archive = CoverageArchive.create(tmp_path, seed=0)
    assert archive.cells == 4096
    assert np.load(tmp_path / "centroids.npy").shape == (4096, len(DESCRIPTORS))
    assert list((tmp_path / "cache").glob("cvt_cells4096_seed0_*.npy"))  # the next run loads it


def test_archive_metrics_feed_the_tracker_and_the_coverage_figure(tmp_path, centroids):
    from openrlhf_populora.analysis import plots
    from openrlhf_populora.analysis.runs import load_run
    from openrlhf_populora.metrics.tracker import Tracker

    archive = CoverageArchive(centroids)
    with Tracker(tmp_path) as tracker:
        for step in range(1, 6):
            archive.add([{"program": program(step + k), "inputs": ["1" * 10 ** (k % 3)]} for k in range(3)],
                        teacher=f"t{step % 2}")
            tracker.log(step, archive.metrics())
    run = load_run(tmp_path)
    xs, ys = run.series("coverage/overall")
    assert xs.tolist() == [1, 2, 3, 4, 5] and np.all(np.diff(ys) >= 0) and ys[-1] == archive.coverage()
    assert set(run.member_series("teacher", "coverage")) == {"t0", "t1"}
    assert len(plots.coverage([run]).axes) == 3
