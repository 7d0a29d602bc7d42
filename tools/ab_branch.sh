#!/usr/bin/env bash
# A/B of a branch against the checkout in one GPU call, rounds interleaved, the SM clock logged.
#
#   bash tools/ab_branch.sh prepare BRANCH      # here (the GPU host gets no .git): BRANCH's
#                                               # mok_cute/ and tools/ into ab_tree/ (untracked,
#                                               # not ignored: the device call carries it)
#   bash tools/ab_branch.sh run ROUNDS 'CMD'    # there: per round CMD in . (AB_SIDE=main) then
#                                               # in ab_tree/ (AB_SIDE=branch), AB_ROUND set;
#                                               # output in $OUT/ab_<side>_<round>.log
#   bash tools/ab_branch.sh clean               # here, after: removes ab_tree/
#
# CMD may use $AB_SIDE, $AB_ROUND and $OUT (single-quoted so they expand per run), e.g.
#   'python3 tools/backward_profile.py --shapes dsv3_ep8_rank --json $OUT/ab_${AB_SIDE}_${AB_ROUND}.json'
# Each run has its own limit (AB_SECS, default 200 s). Keep the winner, delete the branch, and
# add the line to docs/measurements.md (what, measured, commit).
set -u
case "${1:-}" in
  prepare)
    branch="${2:?branch}"
    rm -rf ab_tree && mkdir ab_tree && git archive "$branch" mok_cute tools | tar -x -C ab_tree
    echo "ab_tree/ = $branch ($(git rev-parse --short "$branch")) mok_cute/ tools/"
    ;;
  run)
    rounds="${2:?rounds}" cmd="${3:?command}"
    mkdir -p "${OUT:-out}"
    out="$(cd "${OUT:-out}" && pwd)"  # absolute: the branch side runs in ab_tree/
    [ -d ab_tree ] || { echo "no ab_tree/: run 'prepare BRANCH' before the call" >&2; exit 2; }
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader 2>&1 \
      | sed 's/^/clock at start: /'
    for r in $(seq 1 "$rounds"); do
      for side in main branch; do
        dir=.
        [ "$side" = branch ] && dir=ab_tree
        (cd "$dir" && export AB_SIDE="$side" AB_ROUND="$r" OUT="$out" \
           PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
           && timeout -s KILL "${AB_SECS:-200}" bash -c "$cmd" > "$out/ab_${side}_${r}.log" 2>&1)
        echo "round $r $side rc=$?"
      done
    done
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader 2>&1 \
      | sed 's/^/clock at end: /'
    ;;
  clean)
    rm -rf ab_tree
    ;;
  *)
    echo "usage: tools/ab_branch.sh prepare BRANCH | run ROUNDS 'CMD' | clean" >&2
    exit 2
    ;;
esac
