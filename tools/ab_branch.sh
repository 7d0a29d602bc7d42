#!/usr/bin/env bash
# A/B of a branch against the checkout in one GPU call, rounds interleaved, the SM clock logged.
#
#   bash tools/ab_branch.sh prepare BRANCH      # here (the GPU host gets no .git): BRANCH's
#                                               # mok_cute/ and tools/ into ab_tree/ (untracked,
#                                               # not ignored: the device call carries it)
#   bash tools/ab_branch.sh run ROUNDS 'CMD'    # there: per round CMD in . (AB_SIDE=main) then
#                                               # in ab_tree/ (AB_SIDE=branch), AB_ROUND set;
#                                               # output in $OUT/<tree>_<side>_<round>.log
#   bash tools/ab_branch.sh clean               # here, after: removes ab_tree/
#
# CMD may use $AB_SIDE, $AB_ROUND and $OUT (single-quoted so they expand per run), e.g.
#   'python3 tools/backward_profile.py --shapes dsv3_ep8_rank --json $OUT/ab_${AB_SIDE}_${AB_ROUND}.json'
# Each run has its own limit (AB_SECS, default 200 s). AB_TREE names the tree (default ab_tree):
# several branches can be prepared and A/B'd in one call. Keep the winner, delete the branch, and
# add the line to docs/measurements.md (what, measured, commit).
set -u
tree="${AB_TREE:-ab_tree}"
case "${1:-}" in
  prepare)
    branch="${2:?branch}"
    rm -rf "$tree" && mkdir "$tree" && git archive "$branch" mok_cute tools tests | tar -x -C "$tree"
    echo "$tree/ = $branch ($(git rev-parse --short "$branch")) mok_cute/ tools/"
    ;;
  run)
    rounds="${2:?rounds}" cmd="${3:?command}"
    mkdir -p "${OUT:-out}"
    out="$(cd "${OUT:-out}" && pwd)"  # absolute: the branch side runs in ab_tree/
    [ -d "$tree" ] || { echo "no $tree/: run 'prepare BRANCH' before the call" >&2; exit 2; }
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader 2>&1 \
      | sed 's/^/clock at start: /'
    for r in $(seq 1 "$rounds"); do
      for side in main branch; do
        dir=.
        [ "$side" = branch ] && dir="$tree"
        (cd "$dir" && export AB_SIDE="$side" AB_ROUND="$r" OUT="$out" \
           PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
           && timeout -s KILL "${AB_SECS:-200}" bash -c "$cmd" > "$out/${tree}_${side}_${r}.log" 2>&1)
        echo "round $r $side rc=$?"
      done
    done
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader 2>&1 \
      | sed 's/^/clock at end: /'
    ;;
  clean)
    rm -rf "$tree"
    ;;
  *)
    echo "usage: tools/ab_branch.sh prepare BRANCH | run ROUNDS 'CMD' | clean" >&2
    exit 2
    ;;
esac
