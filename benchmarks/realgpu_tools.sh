#!/usr/bin/env bash
# Makes the TOOLS directory benchmarks/realgpu.sh needs, on this Debian 12 machine, for a bare
# GPU node whose python3 is PYVER (default 3.12, the lent nodes' Ubuntu 24.04 with PyTorch):
#
#     benchmarks/realgpu_tools.sh TOOLS [PYVER]
#
# runc and a static busybox (Debian's), the shared libraries runc and NVIDIA's cli need (lib/),
# NVIDIA's tools to compare with (../shared/anchors, never part of this repository), wheels of
# what the node's python lacks (whl/), and python-prctl's sdist with libcap's header (sdist/,
# inc/): PyPI has no wheel of it, so realgpu.sh builds one on the node with the node's compiler;
# and containerd 1.6, its runc v2 shim, ctr and dockerd 20.10, xz-compressed (engines/: the
# engines step). About 63 MiB; carry it to the node with the checkout (the device tool: `carry`;
# its limit is 64 MiB with the checkout: leave grpcio's wheel behind where the node has grpcio).
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${1:?usage: benchmarks/realgpu_tools.sh TOOLS [PYVER]} pyver=${2:-3.12}
anchors=${ANCHORS:-../shared/anchors/nvidia-anchors.tar.xz}   # or set ANCHORS
[ -f "$anchors" ] || { echo "realgpu_tools: $anchors: not found" >&2; exit 1; }
rm -rf "$tools" && mkdir -p "$tools/lib" "$tools/whl" "$tools/sdist" "$tools/inc/sys"
cp /usr/sbin/runc /bin/busybox "$anchors" "$tools/"
for l in libcap.so.2 libelf.so.1 libseccomp.so.2 libtirpc.so.3 libgssapi_krb5.so.2 libkrb5.so.3 \
         libk5crypto.so.3 libkrb5support.so.0 libcom_err.so.2 libkeyutils.so.1; do
    cp -L "/lib/x86_64-linux-gnu/$l" "$tools/lib/"
done
cp -L /lib/x86_64-linux-gnu/libdevmapper.so.1.02.1 "$tools/lib/"   # dockerd's, which a node may lack
ln -s libcap.so.2 "$tools/lib/libcap.so"
cp /usr/include/sys/capability.h "$tools/inc/sys/"
mkdir "$tools/engines"
for b in containerd containerd-shim-runc-v2 ctr dockerd; do xz -T0 -6 -c "$(command -v $b)" > "$tools/engines/$b.xz"; done
pip=(.venv/bin/python -m pip download -q --no-deps --disable-pip-version-check)
binary=(--only-binary=:all: --python-version "$pyver" --implementation cp --platform any
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the versions the device plugin's and the DRA driver's generated modules want (pyproject.toml),
# lightkube and what it needs; the node's own anyio/idna may be older than httpx2 asks
"${pip[@]}" "${binary[@]}" -d "$tools/whl" pyelftools "grpcio==1.85.1" "protobuf>=7.35.1,<8" \
    lightkube lightkube-models httpx2 httpcore2 msgspec truststore anyio idna h11 typing-extensions
"${pip[@]}" --no-binary :all: -d "$tools/sdist" python-prctl
du -sh "$tools"
