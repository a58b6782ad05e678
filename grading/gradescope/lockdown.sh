#!/usr/bin/env bash
# The reference out of the submission's reach (run by setup.sh as root, once, on the unpacked bundle):
# solutions/, tests/, grading/ and .distlab/ (the reference run's checks, distlab/grading/verdict.py) become
# readable by root only; everything a rank needs to run the
# learner's code (distlab/, the phase folders with the untouched templates, the venv) stays readable.
# The submission's code then runs as RANK_USER in the grading jail (distlab/grading/jail.py), which also
# hides this checkout from it: the permissions here are a second wall, not the only one.
#   grading/gradescope/lockdown.sh SOURCE_DIR [RANK_USER]
set -euo pipefail
SOURCE=${1:?usage: lockdown.sh SOURCE_DIR [RANK_USER]}
RANK_USER=${2:-distlab-student}
[[ $(id -u) == 0 ]] || { echo "lockdown.sh: run as root (Gradescope's setup.sh is)" >&2; exit 2; }
id -u "$RANK_USER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$RANK_USER"
mkdir -p "$SOURCE/.distlab"
chown -R root:root "$SOURCE/solutions" "$SOURCE/tests" "$SOURCE/grading" "$SOURCE/.distlab"
chmod -R go-rwx "$SOURCE/solutions" "$SOURCE/tests" "$SOURCE/grading" "$SOURCE/.distlab"
chmod o+x "$SOURCE/grading" "$SOURCE/grading/gradescope"   # run_autograder is started from here by root
echo "$RANK_USER" > "$SOURCE/.rank_user"
