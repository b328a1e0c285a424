#!/bin/sh
# Writes a run's bearer tokens (docs/kubernetes.md, "Tokens"), none of them tracked by git:
#   base/common/operator-token          the operator token: it alone may move fragments
#                                       (atoll reshard, the shards' preStop drain); the
#                                       syncer's cluster only
#   overlays/OVERLAY/learner-tokens.env LEARNER_ID=TOKEN, one line per learner of that
#                                       learner cluster: the ids its .example lists
#   base/common/token                   the shards' token file: the operator token, then
#                                       LEARNER_ID TOKEN for every learner of every OVERLAY
# Name every learner overlay of the run, all-in-one included when you use it:
#   k8s/tokens.sh learners-tpu-v5p learners-tpu-v6e
# Tokens already written are kept, so running it again with another overlay, or after
# adding ids to an .example, adds only what is missing. Rotate a token by deleting its
# line (or file) and running it again, then apply the overlays it changed.
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

{
    echo "# Written by k8s/tokens.sh: the operator token, then each learner's."
    cat base/common/operator-token
    echo
    for overlay in "$@"; do
        sed -n 's/^\([^#=][^=]*\)=\(.*\)$/\1 \2/p' "overlays/$overlay/learner-tokens.env"
    done
} > base/common/token
