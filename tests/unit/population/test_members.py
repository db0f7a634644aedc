"""Members, populations and lineage (no torch)."""

import sys

import pytest

from openrlhf_populora.population import EvolutionAction, Member, Population


def _action(**overrides):
    fields = dict(step=5, slot="t1", replaced="t1", new_id="t2", role="teacher", operator="svd_mean",
                  parents=("t0",), parent_adapters=("t0",), seed=7)
    fields.update(overrides)
    return EvolutionAction(**fields)


def test_population_package_does_not_import_torch():
    # pure logic: importing the package must not pull torch in (checked in a fresh interpreter)
    import subprocess

    code = "import sys, openrlhf_populora.population; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("teachers,students", [(1, 1), (4, 4), (8, 8), (3, 5)])
def test_create_ids_roles_and_slots(teachers, students):
    population = Population.create(teachers, students)
    assert [m.id for m in population.teachers()] == [f"t{i}" for i in range(teachers)]
    assert [m.id for m in population.students()] == [f"s{i}" for i in range(students)]
    assert all(m.adapter == m.id and m.operator == "init" and m.parents == [] for m in population.members)
    assert len(population) == teachers + students
    assert not population.is_baseline


def test_baseline_is_one_member_playing_both_roles():
    population = Population.baseline()
    (agent,) = population.alive()
    assert agent.id == "b0" and agent.role == "both"
    assert population.teachers() == population.students() == [agent]
    assert population.is_baseline
    with pytest.raises(ValueError, match="baseline"):
        population.add(Member("t0", "teacher", "t0"))


def test_invalid_members_and_sizes():
    with pytest.raises(ValueError, match="teacher"):
        Population.create(0, 2)
    with pytest.raises(ValueError, match="role"):
        Member("x", "coach", "x")
    population = Population.create(1, 1)
    with pytest.raises(ValueError, match="duplicate"):
        population.add(Member("t0", "teacher", "other"))
    with pytest.raises(ValueError, match="slot"):
        population.add(Member("t9", "teacher", "t0"))


def test_record_retires_member_and_keeps_lineage():
    population = Population.create(2, 1)
    assert population.next_ids("teacher", 2) == ["t2", "t3"]
    child = population.record(_action(), info={"truncation_energy": 0.25})
    assert child.id == "t2" and child.adapter == "t1" and child.birth_step == 5 and child.parents == ["t0"]
    assert child.operator == "svd_mean" and child.op_seed == 7 and child.info["truncation_energy"] == 0.25
    assert not population.get("t1").alive and population.get("t1").retired_step == 5
    assert population.member_in("t1").id == "t2"
    assert [m.id for m in population.teachers()] == ["t0", "t2"]
    assert population.next_ids("teacher") == ["t3"]
    assert child.age(12) == 7
    # a grandchild: lineage walks back through both generations
    population.record(_action(step=9, slot="t0", replaced="t0", new_id="t3", parents=("t2",),
                              parent_adapters=("t1",)))
    assert population.lineage("t3") == ["t2", "t0"]


def test_record_rejects_inconsistent_actions_without_changing_anything():
    population = Population.create(2, 1)
    before = population.to_dict()
    with pytest.raises(ValueError, match="slot"):
        population.record(_action(slot="t0"))
    with pytest.raises(ValueError, match="duplicate"):
        population.record(_action(new_id="t0"))
    with pytest.raises(KeyError):
        population.record(_action(parents=("t7",)))
    assert population.to_dict() == before
    population.record(_action())
    with pytest.raises(ValueError, match="retired"):
        population.record(_action(new_id="t5"))


def test_json_round_trip_with_lineage(tmp_path):
    population = Population.create(2, 2)
    population.record(_action(), info={"truncation_energy": 0.1})
    population.get("s0").rating = {"mu": 26.0, "sigma": 7.0, "conservative": 5.0}
    path = tmp_path / "population.json"
    population.save(path)
    again = Population.load(path)
    assert again.to_dict() == population.to_dict()
    assert [m.id for m in again.alive()] == [m.id for m in population.alive()]
    assert again.get("t1").retired_step == 5 and again.get("t2").parents == ["t0"]
    with pytest.raises(ValueError, match="members"):
        Population.from_dict({"nope": []})


def test_a_population_reads_as_its_living_members():
    assert "t0@t0, s0@s0" in repr(Population.create(1, 1))
