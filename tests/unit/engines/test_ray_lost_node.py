"""A lost Ray node is named, not reported as some actor's death (engines/ray/trainer.py: dead_nodes,
_names_lost_nodes). The end-to-end case, a raylet killed mid-step, is in tests/cluster/test_rehearsal.py."""

from __future__ import annotations

import pytest
import ray

from openrlhf_populora.engines.ray import trainer as ray_trainer

HEAD, WORKER = "a" * 28, "b" * 28


def cluster(states: list[list[dict]], monkeypatch) -> list[int]:
    """``ray.nodes()`` answering each state in turn (the last one for ever); returns the call counter."""
    calls = [0]

    def nodes():
        calls[0] += 1
        assert calls[0] < 100, "still polling: no deadline"
        return states[min(calls[0], len(states)) - 1]

    monkeypatch.setattr(ray, "nodes", nodes)
    monkeypatch.setattr(ray_trainer.time, "sleep", lambda s: None)
    return calls


def node(node_id: str, address: str, alive: bool, why: str | None = None) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive,
            **({"DeathReasonMessage": why} if why else {})}


KNOWN = {HEAD: "10.0.0.1", WORKER: "10.0.0.2"}


def test_dead_nodes_names_the_dead_ones_by_address_id_and_reason(monkeypatch):
    # Catches: a dead node looked up by address instead of id, the reason dropped, a live node named.
    cluster([[node(HEAD, "10.0.0.1", True), node(WORKER, "10.0.0.2", False, "health check failed")]], monkeypatch)
    assert ray_trainer.dead_nodes(KNOWN, wait_s=0) == ["10.0.0.2 (node bbbbbbbb, health check failed)"]


def test_dead_nodes_waits_for_the_cluster_to_declare_the_death(monkeypatch):
    # The GCS declares a killed raylet dead only after its health checks fail: the first answers still say alive.
    # Catches: one look only (the survivor's error arrives first and the node would go unnamed).
    alive = [node(HEAD, "10.0.0.1", True), node(WORKER, "10.0.0.2", True)]
    calls = cluster([alive, alive, [node(HEAD, "10.0.0.1", True)]], monkeypatch)  # then gone from the list
    assert ray_trainer.dead_nodes(KNOWN, wait_s=1e9) == ["10.0.0.2 (node bbbbbbbb)"]
    assert calls[0] == 3


def test_dead_nodes_gives_up_after_the_wait(monkeypatch):
    # Catches: waiting for ever when no node died (a Ray error of another kind must still surface).
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(ray_trainer.time, "monotonic", lambda: next(clock))
    calls = cluster([[node(HEAD, "10.0.0.1", True), node(WORKER, "10.0.0.2", True)]], monkeypatch)
    assert ray_trainer.dead_nodes(KNOWN, wait_s=25) == []
    assert calls[0] == 3  # at 10, 20 and 30 (past the deadline of 0 + 25)


class Engine:
    _nodes = KNOWN

    @ray_trainer._names_lost_nodes
    def train_step(self, error):
        raise error


def test_a_ray_error_with_a_dead_node_becomes_lost_node(monkeypatch):
    # Catches: the original error passed on (the user reads "actor died" and no node), the method not named.
    cluster([[node(HEAD, "10.0.0.1", True), node(WORKER, "10.0.0.2", False)]], monkeypatch)
    original = ray.exceptions.RayError("the actor died unexpectedly")
    with pytest.raises(ray_trainer.LostNode) as lost:
        Engine().train_step(original)
    assert str(lost.value) == ("lost Ray node 10.0.0.2 (node bbbbbbbb) in train_step: the actors it held are gone "
                               "(RayError)")
    assert lost.value.__cause__ is original


def test_other_errors_pass_through_unchanged(monkeypatch):
    # Catches: every Ray error called a lost node, and non-Ray errors waited on.
    calls = cluster([[node(HEAD, "10.0.0.1", True), node(WORKER, "10.0.0.2", True)]], monkeypatch)
    monkeypatch.setattr(ray_trainer, "NODE_DEATH_WAIT_S", 0.0)
    original = ray.exceptions.RayError("a task failed")
    with pytest.raises(ray.exceptions.RayError) as same:
        Engine().train_step(original)
    assert same.value is original
    with pytest.raises(ValueError, match="bad input"):
        Engine().train_step(ValueError("bad input"))
    assert calls[0] == 1  # the cluster asked once, for the Ray error only


class Nested(Engine):
    @ray_trainer._names_lost_nodes
    def upload(self, error):
        return self.train_step(error)


def test_nested_engine_calls_ask_the_cluster_once(monkeypatch):
    # train_step calls upload calls check_sync, each decorated. Catches: every level polling again for a dead
    # node (three times NODE_DEATH_WAIT_S before a plain Ray error surfaces).
    calls = cluster([[node(HEAD, "10.0.0.1", True), node(WORKER, "10.0.0.2", True)]], monkeypatch)
    monkeypatch.setattr(ray_trainer, "NODE_DEATH_WAIT_S", 0.0)
    original = ray.exceptions.RayError("a task failed")
    with pytest.raises(ray.exceptions.RayError) as same:
        Nested().upload(original)
    assert same.value is original and calls[0] == 1


def test_the_trainer_actor_is_placed_on_the_head_node():
    # Catches: the controller scheduled anywhere (on the lost node it cannot report the loss).
    options = ray_trainer.PopuLoRATrainer._default_options
    assert options["resources"] == {"node:__internal_head__": 0.001}
