#!/usr/bin/env bash
# A GPU session in one command, on a GPU host whose Python has torch and Lightning but no Hydra (../shared/gpu):
#   bash benchmarks/gpu_session.sh OUT [--only STEP ...] [--budget-s 540]
# Hydra's wheels (.whl/ where the session carried them, else ../shared/gpu/wheels) go into a folder of their own;
# then every step of benchmarks/gpu_session.py in order, each under its own timeout, each result written into OUT
# as it is measured, the summary table last (OUT/summary.md). The whole is cut at the budget and 20 s more.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?give the folder the results go to}"
shift
wheels=.whl
[ -d "$wheels" ] || wheels=../shared/gpu/wheels
site="$(mktemp -d)/site"
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=10 560 python3 -m benchmarks.gpu_session --out "$out" "$@"
