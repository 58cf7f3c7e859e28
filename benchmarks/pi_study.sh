#!/usr/bin/env bash
# The PI study of issue #63: does Position Interpolation lose the passkey skill because the zoo's heads are small?
# The passkey member (rope-llama, d_model 128, 4 layers) at each head dim (same width: 128 / HEAD_DIM heads) and
# training length L, each seed trained to the skill (8,000 steps, passkey share 0.5), then extended x4 by direct,
# PI, NTK and YaRN, on text alone (Chen et al.'s setting) and with the skill mixed into the fine-tuning.
# Run by hand (hours on 2 cores; not in CI). Every step is resumable: rerun the same line after a kill.
#   D=../shared/data/wikitext-2 OUT=pi-study HEAD_DIMS="16 32 64" LENGTHS="64 128" SEEDS="0 1 2" \
#       bash benchmarks/pi_study.sh
# then: posprobe zoo extend-study $OUT/ext-*/ --out $OUT/table (the head-dim x L table: docs/zoo-extend.md).
set -euo pipefail
D=${D:-../shared/data/wikitext-2}
OUT=${OUT:-pi-study}
HEAD_DIMS=${HEAD_DIMS:-16 32 64}
LENGTHS=${LENGTHS:-64 128}
SEEDS=${SEEDS:-0 1 2}
THREADS=${THREADS:-1}
CHECKPOINTS=${CHECKPOINTS:-0 100 200}
PP=${PP:-posprobe}
seeds=()
for s in $SEEDS; do seeds+=(--seed "$s"); done
mkdir -p "$OUT"
for L in $LENGTHS; do
  for hd in $HEAD_DIMS; do
    zoo="$OUT/zoo-hd$hd-L$L"
    start=$(date +%s)
    $PP zoo train --text "$D/valid.txt" --eval-text "$D/test.txt" --member rope-llama --n-heads $((128 / hd)) \
        --length "$L" --steps 8000 --passkey 0.5 "${seeds[@]}" --threads "$THREADS" --no-progress --out "$zoo" \
        > "$zoo.train.txt"
    echo "trained $zoo in $(( $(date +%s) - start )) s" >&2
    for skill in 0 0.5; do
      start=$(date +%s)
      # shellcheck disable=SC2086
      $PP zoo extend "$zoo" --method direct pi ntk yarn --passkey "$skill" --passkey-trials 20 --eval-tokens 4096 \
          --sliding never --checkpoints $CHECKPOINTS --text "$D/valid.txt" --eval-text "$D/test.txt" \
          --threads "$THREADS" --no-progress --out "$OUT/ext-hd$hd-L$L-skill$skill" > "$OUT/ext-hd$hd-L$L-skill$skill.txt"
      echo "extended $zoo (skill $skill) in $(( $(date +%s) - start )) s" >&2
    done
  done
done
