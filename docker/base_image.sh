#!/usr/bin/env bash
# Make the Dockerfile's base image locally, for machines that cannot pull from an image registry:
# a minimal Debian bookworm root filesystem from this machine's own Debian mirror (mmdebstrap),
# imported into podman's store under the name the Dockerfile starts FROM.
#
#   docker/base_image.sh [IMAGE_NAME]      (default: debian:bookworm-slim; needs root, mmdebstrap, podman)
#
# Machines with a registry just pull the official image instead; this script is for CI and sandboxes.
set -euo pipefail

image="${1:-debian:bookworm-slim}"

# The first Debian (non-security) mirror apt is configured with, in either sources format.
debian_mirror() {
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '
        /^URIs:/ { uris = $2 }
        /^Suites:/ { if ($0 ~ /bookworm/ && uris !~ /security/ && !found) { print uris; found = 1 } }')
    if [[ -z "$uri" ]]; then
        uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
              awk '$1 == "deb" && $3 ~ /^bookworm/ && $2 !~ /security/ { print $2; exit }')
    fi
    [[ -n "$uri" ]] || { echo "base_image.sh: no Debian bookworm mirror found in /etc/apt/sources.list*" >&2; exit 1; }
    echo "$uri"
}

if podman image exists "$image"; then
    echo "base_image.sh: $image already exists"
    exit 0
fi
for tool in mmdebstrap podman; do
    command -v "$tool" >/dev/null || { echo "base_image.sh: $tool is not installed" >&2; exit 1; }
done
mirror=$(debian_mirror)
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
echo "base_image.sh: building a minbase bookworm root filesystem from $mirror"
mmdebstrap --quiet --variant=minbase bookworm "$workdir/rootfs.tar" "deb $mirror bookworm main"
podman import --quiet "$workdir/rootfs.tar" "$image" >/dev/null
echo "base_image.sh: imported $image"
