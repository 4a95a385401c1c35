#!/usr/bin/env bash
# Packs, on the CPU machine, what the GPU machine lacks, into pieces that fit the device tool's calls
# (each call sends the working tree plus its carried paths, 64 MiB in all; the tree is ~26 MB):
#   .site/site.tar.xz   Ray 2.60 (stripped binaries, no serve/tune/train/llm/rllib), gguf, jsonschema, rpds:
#                       ~19 MB, from the wheels ../shared/tools/gpu-wheels.sh downloads
#   .smol-a/p0, .smol-b/p1, .smol-c/p2
#                       the SmolLM2-135M-Instruct GGUF (98 MB) in three pieces: p0 travels with .site
# Then three calls, back to back (a warm machine keeps /tmp, not what an earlier call carried):
#   carry [.site, .smol-a]  bash scripts/gpu_session.sh keep env site tests bench
#   carry [.smol-b]         bash scripts/gpu_session.sh keep actors e2e-graphs
#   carry [.smol-c]         bash scripts/gpu_session.sh keep weights smol smolbench
set -euo pipefail
printf "/.whl/\n/.site/\n/.smol-a/\n/.smol-b/\n/.smol-c/\n" >>.git/info/exclude
[ -d .whl ] || bash ../shared/tools/gpu-wheels.sh
work=$(mktemp -d)
for w in .whl/*.whl; do
    case $w in *datasets-* | *multiprocess-* | *dill-*) continue ;; esac  # the GPU checks read no HF dataset
    unzip -q -o "$w" -d "$work"
done
rm -rf "$work"/ray/{serve,tune,train,llm,rllib} "$work"/*/tests
find "$work" -name RECORD -delete
strip --strip-unneeded "$work"/ray/_raylet.so "$work"/ray/core/src/ray/gcs/gcs_server "$work"/ray/core/src/ray/raylet/raylet
mkdir -p .site
tar -cf - -C "$work" . | xz -9 -T2 >.site/site.tar.xz
rm -rf "$work"
gguf=$(python -c "from raysd.models.loading import embedded_gguf_path as p; print(p())")
limit=$((64 * 1024 * 1024 - 400000))  # a margin for edits made after packing
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb | tail -1 | cut -f1)
first=$((limit - tree - $(stat -c %s .site/site.tar.xz)))
second=$((limit - tree))
mkdir -p .smol-a .smol-b .smol-c
head -c "$first" "$gguf" >.smol-a/p0
dd if="$gguf" of=.smol-b/p1 iflag=skip_bytes,count_bytes skip="$first" count="$second" status=none  # not tail | head: SIGPIPE under pipefail
tail -c +$((first + second + 1)) "$gguf" >.smol-c/p2
[ "$(stat -c %s .smol-c/p2)" -le "$second" ] || { echo "the third piece is over a call's room: trim the tree" >&2; exit 1; }
ls -l .site .smol-a .smol-b .smol-c
cat .smol-a/p0 .smol-b/p1 .smol-c/p2 | sha256sum
sha256sum "$gguf"
