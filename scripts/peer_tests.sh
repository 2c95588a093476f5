#!/usr/bin/env bash
# Run the peers' own tests (Lightning 2.6.5's tests_pytorch, Accelerate's tests) against the
# installed Lightning/Accelerate, stock or with GoCkpt injected (tests/peers/gockpt_inject.py).
#
#   bash scripts/peer_tests.sh lightning|accelerate stock|gockpt|gockpt-shim|pristine [extra pytest args]
#
# stock: GoCkpt installed, nothing injected (its entry-point callback is on every Trainer, inert);
# gockpt: GOCKPT_INJECT=1, GoCkptIO / GoCkptPlugin injected; gockpt-shim: the same, and the
# tests read checkpoint directories as files and do not see `latest` (GOCKPT_INJECT_SHIM=1, see
# the plugin's docstring), to find what fails beyond the file-vs-directory layout; pristine: the entry-point callback
# dropped too (GOCKPT_PEER_PRISTINE=1), i.e. Lightning as if GoCkpt were not installed.
#
# Writes $PEERS/<peer>-<mode>.log (pytest -q -rfE output), .xml (junit) and, with gockpt,
# .injected (test ids that built a Trainer/Accelerator with GoCkpt). Compare two runs with
#   $VENV/bin/python tests/peers/compare.py $PEERS/<peer>-stock.xml $PEERS/<peer>-gockpt.xml
#
# Environment (defaults): PEERS=/tmp/peers (scratch: extracted tests, logs), VENV=/tmp/peervenv
# (separate venv: the peers' test deps, e.g. tensorboard, change Lightning's default logger, so
# they stay out of the project's .venv), MIRRORS=/work/.mirror, LIGHTNING_REF=2.6.5,
# ACCELERATE_REF=v<the installed Accelerate's version> (its tests come from the sdist on the package
# index when the mirror has no such tag), PEER_TIMEOUT=120 (seconds per test), PEER_WALL=5400 (seconds in all).
# GOCKPT_SNAPSHOT=<git ref> (e.g. HEAD): test that commit's gockpt/, lightning_gockpt/,
# accelerate_gockpt/ (exported to $PEERS/gockpt-src-<sha>, put first on PYTHONPATH, the built
# native .so copied in) instead of the live, editable work tree - for a long run while others
# edit. Default: the live work tree.
# Extra args replace nothing: they are appended, e.g. -k resume, or test ids relative to the
# run directory ($PEERS/lightning/tests or $PEERS/accelerate) to run only those.
set -uo pipefail

usage() { echo "usage: $0 lightning|accelerate stock|gockpt|gockpt-shim|pristine [pytest args]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
PEER=$1 MODE=$2; shift 2
[[ $PEER == lightning || $PEER == accelerate ]] || usage
[[ $MODE == stock || $MODE == gockpt || $MODE == gockpt-shim || $MODE == pristine ]] || usage

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-/tmp/peers}
VENV=${VENV:-/tmp/peervenv}
MIRRORS=${MIRRORS:-/work/.mirror}
LIGHTNING_REF=${LIGHTNING_REF:-2.6.5}
mkdir -p "$PEERS"

# --- the venv: torch pinned first (never a CUDA build), our package editable (live edits),
# then only what the selected peer tests import.
if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -e "$ROOT[lightning,accelerate,test]"
    "$VENV/bin/pip" install -q "pytest-timeout==2.4.0" pytest-rerunfailures "cloudpickle>=1.3,<3.2.0" \
        scikit-learn "tensorboard>=2.11,<2.21.0" "jsonargparse[signatures]>=4.39.0,<4.46.0" \
        "omegaconf>=2.2.3,<2.4.0" "hydra-core>=1.2.0,<1.4.0" parameterized
fi

# --- the peers' tests, extracted once from the bare mirrors (nothing of theirs enters our repo)
extract() {  # git-dir ref dest paths...
    local gitdir=$1 ref=$2 dest=$3; shift 3
    [[ -f $dest/.extracted-$ref ]] && return 0
    rm -rf "$dest" && mkdir -p "$dest"
    git --git-dir="$gitdir" archive "$ref" "$@" 2>"$PEERS/extract-${ref}.err" | tar -x -C "$dest" || { echo "extracting $ref failed" >&2; exit 1; }
    touch "$dest/.extracted-$ref"
}

if [[ $PEER == lightning ]]; then
    # pyproject.toml: upstream's pytest options (--strict-markers, --doctest-modules, FutureWarning as error)
    extract "$MIRRORS/Lightning-AI+pytorch-lightning/repo" "$LIGHTNING_REF" "$PEERS/lightning" \
        tests/tests_pytorch pyproject.toml
    RUNDIR=$PEERS/lightning/tests
    SELECTION=(
        tests_pytorch/checkpointing
        tests_pytorch/models/test_restore.py
        tests_pytorch/models/test_hooks.py
        tests_pytorch/models/test_hparams.py
        tests_pytorch/loops
        tests_pytorch/callbacks/test_early_stopping.py
        tests_pytorch/callbacks/test_stochastic_weight_avg.py
        tests_pytorch/callbacks/test_weight_averaging.py
        tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py
        tests_pytorch/callbacks/test_timer.py
        tests_pytorch/callbacks/test_lr_monitor.py
        tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py
        tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py
        tests_pytorch/callbacks/test_model_checkpoint_step_interval_val_metric.py
        tests_pytorch/callbacks/test_callbacks.py
        tests_pytorch/callbacks/test_lambda_function.py
        tests_pytorch/callbacks/test_throughput_monitor.py
        tests_pytorch/trainer/connectors/test_callback_connector.py
        tests_pytorch/callbacks/test_finetuning_callback.py
        tests_pytorch/callbacks/test_pruning.py
        tests_pytorch/tuner
        tests_pytorch/trainer/logging_
        tests_pytorch/trainer/test_trainer.py
        tests_pytorch/core/test_saving.py
        tests_pytorch/trainer/connectors/test_checkpoint_connector.py
        # legacy checkpoints are downloaded by Lightning's CI (not in git, no internet here)
        --ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py
    )
else
    # The tests of the Accelerate release installed: a new release reaches users before our mirror
    # has its tag, so fall back to the release's sdist (it ships tests/).
    ACCELERATE_REF=${ACCELERATE_REF:-v$("$VENV/bin/python" -c 'import accelerate; print(accelerate.__version__)')}
    if git --git-dir="$MIRRORS/huggingface+accelerate/repo" rev-parse -q --verify "$ACCELERATE_REF^{commit}" >/dev/null 2>&1; then
        extract "$MIRRORS/huggingface+accelerate/repo" "$ACCELERATE_REF" "$PEERS/accelerate" tests
    elif [[ ! -f $PEERS/accelerate/.extracted-$ACCELERATE_REF ]]; then
        rm -rf "$PEERS/accelerate" "$PEERS/accelerate-sdist" && mkdir -p "$PEERS/accelerate" "$PEERS/accelerate-sdist"
        "$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$PEERS/accelerate-sdist" "accelerate==${ACCELERATE_REF#v}" \
            || { echo "no tag $ACCELERATE_REF in the mirror and no sdist on the index" >&2; exit 1; }
        tar -xzf "$PEERS"/accelerate-sdist/accelerate-*.tar.gz -C "$PEERS/accelerate" --strip-components=1 --wildcards '*/tests' \
            || { echo "extracting the sdist's tests failed" >&2; exit 1; }
        touch "$PEERS/accelerate/.extracted-$ACCELERATE_REF"
    fi
    RUNDIR=$PEERS/accelerate
    SELECTION=(tests/test_state_checkpointing.py tests/test_accelerator.py)
fi

# Explicit test ids among the extra args replace the default selection.
for a in "$@"; do
    if [[ $a != -* && -e $RUNDIR/${a%%::*} ]]; then SELECTION=(); break; fi
done
EXISTING=()
for s in "${SELECTION[@]}"; do
    if [[ $s == -* || -e $RUNDIR/$s ]]; then EXISTING+=("$s"); else echo "note: $s does not exist at this ref; skipped" >&2; fi
done

OUT=$PEERS/$PEER-$MODE
rm -f "$OUT.injected"
export PYTHONPATH="$ROOT/tests/peers${PYTHONPATH:+:$PYTHONPATH}"
SOURCE="live work tree $ROOT @ $(git -C "$ROOT" rev-parse --short HEAD) + $(git -C "$ROOT" status --short -- gockpt lightning_gockpt accelerate_gockpt | wc -l) changed files"
if [[ -n ${GOCKPT_SNAPSHOT:-} ]]; then
    SHA=$(git -C "$ROOT" rev-parse --short "$GOCKPT_SNAPSHOT") || exit 1
    SNAP=$PEERS/gockpt-src-$SHA
    if [[ ! -d $SNAP ]]; then
        mkdir -p "$SNAP.tmp"
        git -C "$ROOT" archive "$SHA" gockpt lightning_gockpt accelerate_gockpt | tar -x -C "$SNAP.tmp" || exit 1
        cp "$ROOT"/gockpt/_gockpt_native*.so "$SNAP.tmp/gockpt/" 2>/dev/null || true
        mv "$SNAP.tmp" "$SNAP"
    fi
    export PYTHONPATH="$SNAP:$PYTHONPATH"
    SOURCE="snapshot of $SHA at $SNAP"
fi
unset GOCKPT_INJECT GOCKPT_INJECT_LOG GOCKPT_PEER_PRISTINE GOCKPT_INJECT_SHIM
if [[ $MODE == gockpt* ]]; then
    export GOCKPT_INJECT=1 GOCKPT_INJECT_LOG=$OUT.injected
    [[ $MODE == gockpt-shim ]] && export GOCKPT_INJECT_SHIM=1
elif [[ $MODE == pristine ]]; then
    export GOCKPT_PEER_PRISTINE=1
fi

cd "$RUNDIR"
REF=$LIGHTNING_REF; [[ $PEER == accelerate ]] && REF=$ACCELERATE_REF
VERSIONS=$("$VENV/bin/python" -c 'import lightning, accelerate, torch, gockpt; print("lightning", lightning.__version__, "accelerate", accelerate.__version__, "torch", torch.__version__, "gockpt", gockpt.__file__)' 2>&1 | tail -n 1)
echo "== $PEER tests @ $REF, $MODE, $VERSIONS, GoCkpt from $SOURCE, $(date -Is)" > "$OUT.log"
timeout -k 30 "${PEER_WALL:-5400}" "$VENV/bin/python" -m pytest -p gockpt_inject -p no:cacheprovider \
    --color=no -q -rfE --timeout="${PEER_TIMEOUT:-120}" --junitxml="$OUT.xml" \
    "${EXISTING[@]}" "$@" >> "$OUT.log" 2>&1
rc=$?
echo "== exit $rc $(date -Is)" >> "$OUT.log"
tail -n 5 "$OUT.log"
exit $rc
