#!/usr/bin/env bash
# One entry point for a fresh machine. The first call builds .venv from the
# pinned lock files in requirements/; later calls reuse it (rebuilt when a
# lock file changes).
#
#   ./dev.sh train [args]   train on an embedded local Ray cluster (python -m jobs.train)
#   ./dev.sh test  [args]   ruff, mypy and the test suite
#   ./dev.sh bench NAME     run a benchmark (python -m benchmarks.NAME; docs/benchmarks.md)
#   ./dev.sh python ...     the project's interpreter
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
venv="$root/.venv"
py="${RAYTREC_PYTHON:-python3.11}"

setup() {
  local stamp="$venv/.raytrec-stamp" want
  want="$(cat requirements/*.lock | sha256sum | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return; fi
  command -v "$py" >/dev/null || { echo "dev.sh: $py not found (set RAYTREC_PYTHON to a Python 3.11 interpreter)" >&2; exit 2; }
  echo "dev.sh: building $venv (first run only)..." >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # pip byte-compiles what it installs (minutes): keep it. Where PYTHONDONTWRITEBYTECODE is set,
  # --no-compile would leave every process (each Ray worker) compiling torch and ray from source.
  local pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
  if [[ "${RAYTREC_CUDA:-}" == 1 ]] || { [[ -z "${RAYTREC_CUDA:-}" ]] && command -v nvidia-smi >/dev/null; }; then
    # CUDA host: the CUDA torch build with its nvidia-* wheels, and FBGEMM's CUDA kernels.
    "${pip[@]}" torch==2.13.0 fbgemm-gpu==1.8.0
  else
    # CPU host: torch's CPU build and FBGEMM's CPU kernels. torchrec declares a
    # dependency on the CUDA fbgemm-gpu wheel, so nothing is resolved here:
    # every transitive dependency is pinned in the lock files instead.
    "${pip[@]}" --no-deps torch==2.13.0 fbgemm-gpu-cpu==1.8.0
  fi
  "${pip[@]}" --no-deps -r requirements/base.lock -r requirements/dev.lock
  "${pip[@]}" --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  train) setup; exec "$venv/bin/python" -m jobs.train "$@" ;;
  test)
    setup
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    "$venv/bin/mypy"
    if [[ $# -eq 0 ]]; then
      # Every test. The fast tier first: a failure there stops before the slow tiers start;
      # the second run takes exactly the tests the first left out.
      "$venv/bin/python" -m pytest -m "not cluster and not multiprocess"
      exec "$venv/bin/python" -m pytest -m "cluster or multiprocess"
    fi
    exec "$venv/bin/python" -m pytest "$@" ;;
  bench) setup; name="$1"; shift; exec "$venv/bin/python" -m "benchmarks.$name" "$@" ;;
  python) setup; exec "$venv/bin/python" "$@" ;;
  setup) setup ;;
  *) echo "usage: ./dev.sh {train|test|bench NAME|python|setup} [args]" >&2; exit 2 ;;
esac
