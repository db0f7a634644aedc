"""Committed results are what the code computes from their own files: the headline pass@1 table of the laptop
experiment (``results/cpu-signature-v2/table``), summarized again from its graded samples, renders byte for byte
as committed. A change to the table's statistics or its formatting that would alter a published number fails
here, before the README quotes a table that the code no longer makes."""

from __future__ import annotations

import json

from paths import ROOT

from openrlhf_populora.eval.report import csv_table, markdown_table, summarize

TABLE = ROOT / "results" / "cpu-signature-v2" / "table"


def test_the_seed_1_table_re_renders_byte_for_byte_from_its_samples():
    """Catches: a changed bootstrap (seed, resample count, percentile), interval, mean, best/worst pick, row
    order or number format; and a results.json/results.md pair that no longer matches its samples.jsonl."""
    committed = json.loads((TABLE / "results.json").read_text())
    members = committed["members"]
    groups: dict[str, list[str]] = {}
    for name, member in members.items():  # results.json keeps the members in the order they were evaluated
        groups.setdefault(member["group"], []).append(name)
    records = [json.loads(line) for line in (TABLE / "samples.jsonl").read_text().splitlines()]
    records = [r for r in records if r["member"] in members and r["benchmark"] in committed["benchmarks"]]
    summary = summarize(records, groups, committed["benchmarks"], totals=committed["totals"],
                        roles={name: m["role"] for name, m in members.items()}, untrained=committed["untrained"],
                        select_on=committed["selection"]["benchmarks"])
    for key in ("settings", "samples", "limit"):  # provenance cli.evaluate adds beside the summary
        summary[key] = committed[key]
    assert markdown_table(summary) == (TABLE / "results.md").read_text()
    assert csv_table(summary) == (TABLE / "results.csv").read_text()
    assert json.dumps(summary, indent=2) == (TABLE / "results.json").read_text()
