#!/usr/bin/env bash
# `make test-compat`: the tests marked torch_compat (chosen in tests/conftest.py) on the oldest torch
# that pyproject.toml declares (`torch>=X` -> torch==X) and on the newest torch pip can install here,
# each in its own venv with ember installed editable with the dev extra.
#
# Settings (environment):
#   COMPAT_TORCH   torch versions to test instead of the two ends, e.g. "2.4.0 2.14.1"
#   COMPAT_VENVS   where the per-version venvs live (default .venv-compat in the checkout)
#   COMPAT_WHEELS  where each version's torch wheels are kept between runs (default below)
#   PYTHON         the interpreter the venvs are made from (default python3)
# A file ci/compat/torch-<version>.txt, if present, holds pip constraints for that version's venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
unset PYTHONPATH  # the venvs import ember from this checkout through their editable install

PYTHON=${PYTHON:-python3}
VENVS=${COMPAT_VENVS:-$PWD/.venv-compat}
# A CUDA build of torch with its nvidia-* dependencies is about 3 GB. PyPI's responses reach this
# machine without caching headers, so pip's HTTP cache keeps none of it: keep the wheels ourselves,
# beside pip's cache (which CI keeps between runs), so a fresh clone downloads them only once.
WHEELS=${COMPAT_WHEELS:-$HOME/.cache/pip/ember-compat-wheels}
MARKER="torch_compat and not slow"

log() { printf '[test-compat %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# The lower bound of the torch requirement in pyproject.toml.
declared_floor() {
    "$PYTHON" - <<'EOF'
import re, sys
text = open("pyproject.toml", encoding="utf-8").read()
found = re.findall(r'"torch\s*>=\s*([0-9][0-9.]*)', text)
if len(found) != 1:
    sys.exit(f"test-compat: expected one 'torch>=X' requirement in pyproject.toml, found {found}")
print(found[0])
EOF
}

# The exact version pip would install for a requirement (under this machine's pip configuration).
resolve() {
    "$RESOLVER/bin/python" -m pip install --quiet --dry-run --ignore-installed --no-deps \
        --report - "$1" | "$RESOLVER/bin/python" -c \
        'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])'
}

# Creates (or reuses) the venv for one torch version; prints nothing on reuse.
prepare() {
    local version=$1 venv=$VENVS/torch-$1 wheels=$WHEELS/torch-$1 pins
    pins=$(mktemp)
    echo "torch==$version" > "$pins"
    local constraints=(-c "$pins")
    [[ -f ci/compat/torch-$version.txt ]] && constraints+=(-c "ci/compat/torch-$version.txt")
    local stamp=$venv/.ember-compat-installed
    if [[ -f $stamp && $stamp -nt pyproject.toml && $stamp -nt setup.py \
          && ( ! -f ci/compat/torch-$version.txt || $stamp -nt ci/compat/torch-$version.txt ) ]]; then
        log "torch $version: reusing $venv"
        rm -f "$pins"
        return
    fi
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    mkdir -p "$wheels"
    if [[ ! -f $wheels/.complete ]]; then  # torch==X pins its own dependencies: fetched once
        log "torch $version: fetching torch and its dependencies into $wheels"
        local before after start=$SECONDS
        before=$(du -sm "$wheels" | cut -f1)
        "$venv/bin/python" -m pip download --quiet --progress-bar off --find-links "$wheels" \
            --dest "$wheels" "${constraints[@]}" "torch==$version"
        after=$(du -sm "$wheels" | cut -f1)
        log "torch $version: wheels ${after} MB ($((after - before)) MB new, $((SECONDS - start)) s)"
        touch "$wheels/.complete"
    fi
    log "torch $version: installing torch into $venv"
    "$venv/bin/python" -m pip install --quiet --progress-bar off --no-index --find-links "$wheels" \
        "${constraints[@]}" "torch==$version"
    log "torch $version: installing ember[dev]"
    "$venv/bin/python" -m pip install --quiet --progress-bar off "${constraints[@]}" -e ".[dev]"
    rm -f "$pins"
    touch "$stamp"
}

# Runs the marked tests in one version's venv after checking it imports this checkout and that torch.
run_tests() {
    local version=$1 venv=$VENVS/torch-$1
    "$venv/bin/python" - "$version" "$PWD/src" <<'EOF'
import os, sys
import torch
import ember
want, src = sys.argv[1], os.path.realpath(sys.argv[2])
if torch.__version__.split("+")[0] != want.split("+")[0]:
    sys.exit(f"test-compat: venv has torch {torch.__version__}, expected {want}")
if not os.path.realpath(ember.__file__).startswith(src + os.sep):
    sys.exit(f"test-compat: ember imported from {ember.__file__}, expected under {src}")
EOF
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "$MARKER" tests
}

mkdir -p "$VENVS"
RESOLVER=$VENVS/resolver
if [[ ! -x $RESOLVER/bin/python ]]; then
    "$PYTHON" -m venv "$RESOLVER"
    "$RESOLVER/bin/python" -m pip install --quiet --upgrade pip
fi

if [[ -n ${COMPAT_TORCH:-} ]]; then
    read -r -a versions <<< "$COMPAT_TORCH"
else
    floor=$(declared_floor)
    versions=("$(resolve "torch==$floor")" "$(resolve torch)")
    log "declared torch>=$floor; testing torch ${versions[*]}"
fi

# on a default run, the wheels and venvs of versions no longer at an end of the range are dropped
for folder in "$WHEELS"/torch-* "$VENVS"/torch-*; do
    [[ -z ${COMPAT_TORCH:-} && -d $folder ]] || continue
    keep=0
    for version in "${versions[@]}"; do [[ ${folder##*/} == "torch-$version" ]] && keep=1; done
    if [[ $keep == 0 ]]; then log "removing $folder (no longer an end of the range)"; rm -rf "$folder"; fi
done

declare -A outcome
failed=0
for version in "${versions[@]}"; do
    start=$SECONDS
    prepare "$version"
    setup=$((SECONDS - start))
    start=$SECONDS
    if run_tests "$version"; then result=passed; else result=FAILED; failed=1; fi
    outcome[$version]="$result (setup ${setup}s, tests $((SECONDS - start))s)"
    log "torch $version: ${outcome[$version]}"
done

log "summary:"
for version in "${versions[@]}"; do log "  torch $version: ${outcome[$version]}"; done
exit "$failed"
