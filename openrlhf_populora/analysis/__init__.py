"""Analysis: what is computed from finished run directories. Nothing here runs during training.

- reading runs back, tolerant of crashes and older schemas   (runs.py)
- the paper's signature, population against baseline          (signature.py, its statistics signature_stats.py)
- comparing arms: checks, attribution, outputs of cli.compare  (compare.py)
- the mode-collapse definition of the 120-step study          (collapse.py)
- the operator retention study's measures                     (retention.py)
- figures and ``summary.md``: ``render_report``               (report.py, plots.py; matplotlib on demand)
- stock OpenRLHF's TensorBoard logs as runs                   (stock_logs.py)
- synthetic runs with known trends, for tests and calibration (synthetic.py)
"""


def __getattr__(name: str):
    if name == "render_report":  # imports matplotlib: only on demand
        from openrlhf_populora.analysis.report import render_report

        return render_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
