"""The operator menu (``population/operators.py``): names, aliases and each operator's parameters, checked with
the menu named in the refusal."""

from __future__ import annotations

import pytest

from openrlhf_populora.population import (
    OperatorParams,
    canonical_operator,
    operator_params,
)


def test_an_unknown_operator_is_refused_with_the_menu():
    with pytest.raises(ValueError, match=r"unknown evolution operator 'M99'; choose from: M1 gaussian, .*X9 "
                                         r"task_arithmetic, copy_parent, linear_0_5$"):
        canonical_operator("M99")


@pytest.mark.parametrize("field, value, message", [
    ("sv_splice_top", 2.5, "evolution.params.sv_splice_top must be an integer, got 2.5"),
    ("sv_splice_top", True, "evolution.params.sv_splice_top must be an integer, got True"),
    ("sv_splice_top", -1, r"evolution.params.sv_splice_top must be in \[0, inf\), got -1"),
    ("slerp_t", 1.5, r"evolution.params.slerp_t must be in \[0, 1\], got 1.5"),
])
def test_operator_parameters_are_checked_even_where_the_default_is_none(field, value, message):
    """Catches: the integer check skipped (a float or a bool taken as a component count), and a parameter whose
    default is None (chosen at run time) never checked once it is set."""
    OperatorParams(sv_splice_top=3, slerp_t=0.5).validate()
    with pytest.raises(ValueError, match=f"^{message}$"):
        OperatorParams(**{field: value}).validate()


def test_an_operator_without_parameters_says_so():
    with pytest.raises(ValueError, match=r"^operator 'svd_mean' takes no parameters, got \['x'\]$"):
        operator_params("svd_mean", {"x": 1})
