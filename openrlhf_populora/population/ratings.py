"""Skill ratings of members behind one small interface, with TrueSkill (default) and OpenSkill backends.

**What a game is.** A matchup pits a teacher against a student: the teacher's valid problems are given to
the student, who samples ``n`` answers per problem. Each problem has a solve rate ``p`` in [0, 1].
``outcomes_from_solve_rates`` turns a batch of solve rates into games, in one of two modes:

- ``"per_matchup"`` (default): ONE game per matchup, decided by the mean solve rate ``m``: the student wins
  if ``m > 0.5 + draw_margin``, the teacher wins if ``m < 0.5 - draw_margin``, otherwise it is a draw. One
  game per matchup and step keeps ``sigma`` from collapsing when batches are large.
- ``"per_problem"``: one game per problem: solve rate 1 (every sample right) is a student win, 0 a teacher
  win, anything in between a draw (the problem was learnable, neither side dominated).

A matchup with no valid problem gives no game (no information, rather than a loss: the teacher's format
failures are punished by its reward, not its rating). Games of one step are applied in the order given.
A member is never rated against itself (the baseline plays itself, so baseline runs keep no ratings).

**Scores.** Selection ranks members by ``mu``, the skill estimate (``population/selection.py`` says why);
``conservative(id) = mu - 3 sigma``, a lower bound on skill, is its alternative (``evolution.score``).
``win_probability(a, b)`` is
``Phi((mu_a - mu_b) / sqrt(2 beta^2 + sigma_a^2 + sigma_b^2))`` for TrueSkill and the library's
``predict_win`` for OpenSkill. ``history`` keeps one ``(mu, sigma)`` entry per member and step (the last
value of the step).

Licensing: TrueSkill(TM) may be used only in non-commercial projects (see the ``trueskill`` package's
LICENSE); OpenSkill (MIT) is the drop-in alternative: ``make_ratings("openskill")``.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

OUTCOMES = ("student", "teacher", "draw")
GAME_MODES = ("per_matchup", "per_problem")


def outcomes_from_solve_rates(solve_rates: Sequence[float], mode: str = "per_matchup",
                              draw_margin: float = 0.1) -> list[str]:
    """Games (``"student"`` win, ``"teacher"`` win or ``"draw"``) from a batch of per-problem solve rates."""
    if mode not in GAME_MODES:
        raise ValueError(f"unknown game mode {mode!r}; choose from {', '.join(GAME_MODES)}")
    if not 0.0 <= draw_margin < 0.5:
        raise ValueError(f"draw_margin must be in [0, 0.5), got {draw_margin}")
    rates = [float(r) for r in solve_rates]
    for rate in rates:
        if not 0.0 <= rate <= 1.0:  # also rejects NaN
            raise ValueError(f"solve rates must be in [0, 1], got {rate}")
    if not rates:
        return []
    if mode == "per_problem":
        return ["student" if r == 1.0 else "teacher" if r == 0.0 else "draw" for r in rates]
    mean = sum(rates) / len(rates)
    if mean > 0.5 + draw_margin:
        return ["student"]
    if mean < 0.5 - draw_margin:
        return ["teacher"]
    return ["draw"]


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class Ratings(ABC):
    """Ratings of members by id. Subclasses wrap one rating library."""

    backend: str = ""

    def __init__(self, mu: float = 25.0, sigma: float = 25.0 / 3.0, beta: float | None = None,
                 tau: float | None = None, draw_probability: float = 0.1, game_mode: str = "per_matchup",
                 draw_margin: float = 0.1) -> None:
        if sigma <= 0 or (beta is not None and beta <= 0) or (tau is not None and tau < 0):
            raise ValueError("ratings need sigma > 0, beta > 0 and tau >= 0")
        if not 0.0 <= draw_probability < 1.0:
            raise ValueError(f"draw_probability must be in [0, 1), got {draw_probability}")
        outcomes_from_solve_rates([], game_mode, draw_margin)  # validates mode and margin
        self.params = {"mu": mu, "sigma": sigma, "beta": sigma / 2 if beta is None else beta,
                       "tau": sigma / 100 if tau is None else tau, "draw_probability": draw_probability,
                       "game_mode": game_mode, "draw_margin": draw_margin}
        self._ratings: dict[str, tuple[float, float]] = {}
        self.history: dict[str, list[dict[str, float]]] = {}
        self.games = 0

    # backend hooks ------------------------------------------------------------------------------------
    @abstractmethod
    def _rate(self, winner: tuple[float, float], loser: tuple[float, float],
              drawn: bool) -> tuple[tuple[float, float], tuple[float, float]]:
        """New (mu, sigma) of winner and loser after one game (or a draw)."""

    @abstractmethod
    def win_probability(self, a: str, b: str) -> float:
        """P[a beats b] under the current ratings."""

    # members ------------------------------------------------------------------------------------------
    def add(self, member_id: str, mu: float | None = None, sigma: float | None = None, step: int = 0) -> None:
        """Start rating a member (at the default prior unless mu / sigma are given)."""
        if member_id in self._ratings:
            raise ValueError(f"member {member_id!r} is already rated")
        self._ratings[member_id] = (self.params["mu"] if mu is None else float(mu),
                                    self.params["sigma"] if sigma is None else float(sigma))
        self._log(member_id, step)

    def add_child(self, member_id: str, parent_ids: Sequence[str], step: int = 0) -> None:
        """Rate a child of evolution: its parents' mean mu, with the prior sigma.

        The mean mu is the best guess of a child made from its parents' weights; the prior sigma says that guess
        is uncertain (its weights are new), and lets the child's own games move its mu quickly, so that by its
        first evolution event its mu reflects the child, not its parents. Selection ranks by mu by default, so
        this uncertainty alone does not count against the child (``population/selection.py``)."""
        if not parent_ids:
            raise ValueError("add_child needs at least one parent")
        mu = sum(self.mu(p) for p in parent_ids) / len(parent_ids)
        self.add(member_id, mu=mu, step=step)

    def has(self, member_id: str) -> bool:
        return member_id in self._ratings

    def _get(self, member_id: str) -> tuple[float, float]:
        if member_id not in self._ratings:
            raise KeyError(f"member {member_id!r} has no rating; add it first")
        return self._ratings[member_id]

    def mu(self, member_id: str) -> float:
        return self._get(member_id)[0]

    def sigma(self, member_id: str) -> float:
        return self._get(member_id)[1]

    def conservative(self, member_id: str) -> float:
        """``mu - 3 sigma``: a lower bound on skill (selection's ``evolution.score conservative``)."""
        mu, sigma = self._get(member_id)
        return mu - 3.0 * sigma

    def members(self) -> list[str]:
        return list(self._ratings)

    # games --------------------------------------------------------------------------------------------
    def record_game(self, winner: str, loser: str, drawn: bool = False, step: int = 0) -> None:
        """One game; with ``drawn=True`` the order of the two ids does not matter."""
        if winner == loser:
            raise ValueError(f"member {winner!r} cannot be rated against itself")
        new_w, new_l = self._rate(self._get(winner), self._get(loser), drawn)
        self._ratings[winner], self._ratings[loser] = new_w, new_l
        self.games += 1
        self._log(winner, step)
        self._log(loser, step)

    def record_matchup(self, teacher: str, student: str, solve_rates: Sequence[float],
                       step: int = 0) -> list[str]:
        """Turn one matchup's solve rates into games (see the module doc), apply them, return them."""
        if teacher == student:
            raise ValueError(f"member {teacher!r} cannot be rated against itself")
        self._get(teacher), self._get(student)  # fail before anything changes
        games = outcomes_from_solve_rates(solve_rates, self.params["game_mode"], self.params["draw_margin"])
        for outcome in games:
            if outcome == "student":
                self.record_game(student, teacher, step=step)
            elif outcome == "teacher":
                self.record_game(teacher, student, step=step)
            else:
                self.record_game(teacher, student, drawn=True, step=step)
        return games

    def _log(self, member_id: str, step: int) -> None:
        mu, sigma = self._ratings[member_id]
        entry = {"step": step, "mu": mu, "sigma": sigma, "conservative": mu - 3.0 * sigma}
        log = self.history.setdefault(member_id, [])
        if log and log[-1]["step"] == step:
            log[-1] = entry
        else:
            log.append(entry)

    # JSON ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "params": dict(self.params), "games": self.games,
                "ratings": {k: list(v) for k, v in self._ratings.items()},
                "history": {k: [dict(e) for e in v] for k, v in self.history.items()}}

    def to_json(self) -> str:
        return json.dumps(self.state_dict(), indent=2)

    @staticmethod
    def from_state(state: dict[str, Any]) -> Ratings:
        """Rebuild any backend from ``state_dict()`` output."""
        ratings = make_ratings(state["backend"], **state["params"])
        ratings._ratings = {k: (float(v[0]), float(v[1])) for k, v in state["ratings"].items()}
        ratings.history = {k: [dict(e) for e in v] for k, v in state["history"].items()}
        ratings.games = int(state.get("games", 0))
        return ratings

    @staticmethod
    def from_json(text: str) -> Ratings:
        return Ratings.from_state(json.loads(text))


class TrueSkillRatings(Ratings):
    """Microsoft TrueSkill via the ``trueskill`` package (Gaussian belief propagation, 1 vs 1)."""

    backend = "trueskill"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        import trueskill

        p = self.params
        self._env = trueskill.TrueSkill(mu=p["mu"], sigma=p["sigma"], beta=p["beta"], tau=p["tau"],
                                        draw_probability=p["draw_probability"])

    def _rate(self, winner, loser, drawn):
        r1, r2 = self._env.rate_1vs1(self._env.create_rating(*winner), self._env.create_rating(*loser),
                                     drawn=drawn)
        return (r1.mu, r1.sigma), (r2.mu, r2.sigma)

    def win_probability(self, a: str, b: str) -> float:
        (mu_a, s_a), (mu_b, s_b) = self._get(a), self._get(b)
        beta = self.params["beta"]
        return _normal_cdf((mu_a - mu_b) / math.sqrt(2 * beta**2 + s_a**2 + s_b**2))


class OpenSkillRatings(Ratings):
    """Weng-Lin Bayesian ratings via the MIT-licensed ``openskill`` package (Plackett-Luce model).

    ``draw_probability`` is not used by this model (kept for a uniform state format).
    """

    backend = "openskill"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        try:
            from openskill.models import PlackettLuce
        except ImportError as err:  # optional dependency
            raise ImportError("the 'openskill' rating backend needs `pip install openskill`") from err
        p = self.params
        self._model = PlackettLuce(mu=p["mu"], sigma=p["sigma"], beta=p["beta"], tau=p["tau"])

    def _rate(self, winner, loser, drawn):
        teams = [[self._model.rating(*winner)], [self._model.rating(*loser)]]
        (r1,), (r2,) = self._model.rate(teams, ranks=[0, 0] if drawn else [0, 1])
        return (r1.mu, r1.sigma), (r2.mu, r2.sigma)

    def win_probability(self, a: str, b: str) -> float:
        teams = [[self._model.rating(*self._get(a))], [self._model.rating(*self._get(b))]]
        return float(self._model.predict_win(teams)[0])


BACKENDS: dict[str, type[Ratings]] = {"trueskill": TrueSkillRatings, "openskill": OpenSkillRatings}


def make_ratings(backend: str = "trueskill", **params: Any) -> Ratings:
    """A ratings object. ``params``: mu, sigma, beta (default sigma/2), tau (default sigma/100),
    draw_probability, game_mode (``"per_matchup"`` | ``"per_problem"``), draw_margin."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown rating backend {backend!r}; choose from {', '.join(BACKENDS)}")
    return BACKENDS[backend](**params)
