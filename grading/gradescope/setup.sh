#!/usr/bin/env bash
# Gradescope runs this once when it builds the autograder image; the bundle made by
# `python -m distlab.grading.grade --autograder-zip autograder.zip` is unpacked in /autograder/source.
set -euo pipefail
cd /autograder/source
apt-get update -q && apt-get install -y -q python3 python3-pip python3-venv >/dev/null
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q -r requirements.txt
# The reference's checks for every graded test, kept for the grading runs (distlab/grading/verdict.py): each
# submission's passing tests are compared with them instead of running the reference again (minutes, once).
/autograder/venv/bin/python -m pytest -q -p no:cacheprovider -m exercise --record-reference ||
  echo "setup: some reference checks were not recorded; grading runs the reference for those tests itself"
# Last: the reference, the tests and the grading files readable by root only; ranks run as distlab-student.
bash grading/gradescope/lockdown.sh /autograder/source distlab-student
