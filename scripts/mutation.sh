#!/usr/bin/env bash
# Mutation testing of the method's modules with mutmut 3 (the `dev` extra): which broken implementations does
# no test catch? Too slow for CI (tens of minutes to hours on 2 cores); run it by hand.
#
#   scripts/mutation.sh                      # every group, every mutant
#   scripts/mutation.sh rewards evolution    # some groups
#   MUTATION_SAMPLE=37 scripts/mutation.sh loop   # only mutants whose number ends in 3 or 7 (a 20% sample)
#   MUTATION_FUNCTIONS="_rate _trajectories" scripts/mutation.sh loop   # only these functions' mutants
#   MUTATION_REV=a128c85 scripts/mutation.sh      # the code and tests of a commit instead of the work tree
#   MUTATION_MEMORY_KB=4000000 scripts/mutation.sh tasks  # cap each mutant's address space (ulimit -v): a
#       mutant can allocate without bound (one in tasks/parsing.py's fenced_blocks reached 9 GB); not for the
#       groups that load torch, whose address space is larger than what they use
#
# Each group mutates some modules and runs a fast, relevant set of test files (mutmut then runs, for each
# mutant, only the tests among them that execute the mutated function, fastest first, stopping at the first
# failure). mutmut never touches the repository: each group runs in its own copy under $MUTATION_DIR
# (default /tmp/populora-mutation/<group>), one mutant at a time (--max-children 1), under `nice`.
# Prints and writes $MUTATION_DIR/<group>/summary.tsv: module, mutants run, killed, survived, kill rate;
# and survivors.txt, one survivor per line (`mutmut show NAME` in that copy's directory shows its diff).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MUTMUT="$(dirname "$PY")/mutmut"
OUT="${MUTATION_DIR:-/tmp/populora-mutation}"
SAMPLE="${MUTATION_SAMPLE:-}"
FUNCTIONS="${MUTATION_FUNCTIONS:-}"

# group -> "modules to mutate | test files" (test files missing at MUTATION_REV are skipped)
declare -A SETS=(
  [rewards]="openrlhf_populora/rewards.py | tests/unit/test_rewards.py"
  [advantages]="openrlhf_populora/selfplay/advantages.py | tests/unit/selfplay/test_advantages.py"
  [population]="openrlhf_populora/population/* | tests/unit/population/test_members.py tests/unit/population/test_ratings.py tests/unit/population/test_matchmaking.py tests/unit/population/test_selection.py tests/unit/population/test_operators.py tests/unit/evolution/test_operators.py"
  [evolution]="openrlhf_populora/evolution/* | tests/unit/evolution/test_operators.py tests/unit/evolution/test_lowrank.py"
  [loop]="openrlhf_populora/selfplay/loop.py | tests/unit/selfplay/test_rules.py tests/unit/selfplay/test_step_rewards.py"
  [grading]="openrlhf_populora/eval/sanitize.py openrlhf_populora/eval/store.py | tests/unit/eval/test_sanitize.py tests/unit/eval/test_store.py"
  [table]="openrlhf_populora/eval/report.py openrlhf_populora/durable.py | tests/unit/eval/test_report.py tests/unit/test_durable.py"
  [statistics]="openrlhf_populora/analysis/signature_stats.py | tests/unit/analysis/test_signature_stats.py tests/unit/analysis/test_compare_calibration.py tests/integration/test_cli_compare.py"
  [verdicts]="openrlhf_populora/analysis/collapse.py openrlhf_populora/eval/across_seeds.py | tests/unit/analysis/test_collapse.py tests/unit/eval/test_across_seeds.py"
  [tasks]="openrlhf_populora/tasks/* | tests/unit/tasks/test_parsing.py tests/unit/tasks/test_checks.py tests/unit/tasks/test_verify.py tests/unit/tasks/test_buffers.py tests/unit/tasks/test_records_prompts.py tests/unit/tasks/test_seed_verify.py tests/unit/tasks/test_values.py tests/unit/tasks/test_programs.py"
)
ORDER=(rewards advantages population evolution loop tasks grading table statistics verdicts)
[ "$#" -gt 0 ] && ORDER=("$@")

export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

copy_tree() {  # the work tree's files (tracked and untracked, not ignored), or those of $MUTATION_REV
  local dest="$1"
  mkdir -p "$dest"
  if [ -n "${MUTATION_REV:-}" ]; then
    git -C "$ROOT" archive "$MUTATION_REV" | tar -x -C "$dest"
  else
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 tar -cf - --ignore-failed-read 2>/dev/null) \
      | tar -x -C "$dest"
  fi
}

for group in "${ORDER[@]}"; do
  spec="${SETS[$group]:?unknown group $group; groups: ${!SETS[*]}}"
  modules="${spec%%|*}"
  tests="${spec#*|}"
  dir="$OUT/$group"
  rm -rf "$dir"
  copy_tree "$dir"
  cd "$dir"
  present=()
  for t in $tests; do [ -f "$t" ] && present+=("$t"); done
  "$PY" - "$modules" "${present[@]}" <<'EOF'
import json, re, sys
from pathlib import Path
modules, tests = sys.argv[1].split(), sys.argv[2:]
text = Path("pyproject.toml").read_text()
section = ("[tool.mutmut]\n"
           'source_paths = ["openrlhf_populora/"]\n'
           'also_copy = ["configs/"]\n'
           'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
           "use_git_change_detection = false\n"
           f"only_mutate = {json.dumps(modules)}\n"
           f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n")
text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)  # the committed section, if any
Path("pyproject.toml").write_text(text.rstrip() + "\n\n" + section)
EOF
  names=()
  if [ -n "$SAMPLE$FUNCTIONS" ]; then
    for fn in ${FUNCTIONS:-""}; do names+=("*${fn}__mutmut_*${SAMPLE:+[$SAMPLE]}"); done
  fi
  echo "== $group: mutating $modules; tests: ${present[*]}${SAMPLE:+; sample: numbers ending in [$SAMPLE]}${FUNCTIONS:+; functions: $FUNCTIONS}"
  ( [ -n "${MUTATION_MEMORY_KB:-}" ] && ulimit -v "$MUTATION_MEMORY_KB"
    nice -n 10 "$MUTMUT" run --max-children 1 "${names[@]}" ) > run.log 2>&1 || { tail -20 run.log; exit 1; }
  "$MUTMUT" results --all true > results.txt
  "$PY" - <<'EOF'
import re
from collections import Counter
from pathlib import Path
killed_states = {"killed", "timeout", "caught by type check"}
rows: dict[str, Counter] = {}
survivors = []
for line in Path("results.txt").read_text().splitlines():
    m = re.match(r"\s*(\S+)__mutmut_\d+: (.+)$", line)
    if not m or m.group(2).strip() in ("not checked", "skipped"):
        continue
    name, status = line.strip().rsplit(": ", 1)
    module = re.sub(r"\.x(ǁ|_).*$", "", name)
    row = rows.setdefault(module, Counter())
    row["run"] += 1
    if status in killed_states:
        row["killed"] += 1
    else:
        row["survived"] += 1
        survivors.append(f"{name}\t{status}")
lines = ["module\tmutants\tkilled\tsurvived\tkill_rate"]
for module, row in sorted(rows.items()):
    lines.append(f"{module}\t{row['run']}\t{row['killed']}\t{row['survived']}\t{row['killed'] / row['run']:.1%}")
Path("summary.tsv").write_text("\n".join(lines) + "\n")
Path("survivors.txt").write_text("\n".join(survivors) + ("\n" if survivors else ""))
print("\n".join(lines))
EOF
  cd "$ROOT"
done
