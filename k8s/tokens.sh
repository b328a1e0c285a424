#!/bin/sh
# Writes a run's bearer tokens (docs/kubernetes.md, "Tokens"), none of them tracked by git:
#   base/common/operator-token          the operator token: it alone may move fragments
#                                       (atoll reshard, the shards' preStop drain); the
#                                       syncer's cluster only
#   overlays/OVERLAY/learner-tokens.env LEARNER_ID=TOKEN, one line per learner of that
#                                       learner cluster: the ids its .example lists
#   base/common/token                   the shards' token file: the operator token, then
#                                       LEARNER_ID TOKEN for every learner of every
#                                       overlay that has a learner-tokens.env, named
#                                       this time or before
# Name the learner overlays to write tokens for (all-in-one too when you use it):
#   k8s/tokens.sh learners-tpu-v5p learners-tpu-v6e
# Tokens already written are kept, so running it again with another overlay, or after
# adding ids to an .example, adds only what is missing, and the shards' file keeps every
# other overlay's learners. Rotate a token by deleting its line and running it again for
# its overlay, then apply the overlays it changed (the syncer's, and that learner
# overlay). Remove a cluster's learners from the shards' file by deleting its overlay's
# learner-tokens.env and running it for any other overlay.
set -eu
cd "$(dirname "$0")"
[ $# -gt 0 ] || { echo "usage: $0 LEARNER_OVERLAY..." >&2; exit 2; }
umask 077

new_token() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }

for overlay in "$@"; do
    [ -f "overlays/$overlay/learner-tokens.env.example" ] || {
        echo "$0: overlays/$overlay/learner-tokens.env.example: no such file" >&2
        exit 2
    }
done
[ -s base/common/operator-token ] || new_token > base/common/operator-token

for overlay in "$@"; do
    file="overlays/$overlay/learner-tokens.env"
    touch "$file"
    sed -n 's/^\([^#=][^=]*\)=.*/\1/p' "$file.example" | while read -r id; do
        grep -q "^$id=" "$file" || echo "$id=$(new_token)" >> "$file"
    done
done

# From every overlay's learner tokens, not only those named now: the shards admit the
# learners of every cluster of the run. Written aside, then renamed: never half a file.
{
    echo "# Written by k8s/tokens.sh: the operator token, then each learner's."
    cat base/common/operator-token
    echo
    for file in overlays/*/learner-tokens.env; do
        [ -f "$file" ] || continue
        echo "# ${file%/learner-tokens.env}"
        sed -n 's/^\([^#=][^=]*\)=\(.*\)$/\1 \2/p' "$file"
    done
} > base/common/token.new
mv base/common/token.new base/common/token
