#!/usr/bin/env bash
# The self-contained package on a real GPU node (issue 36), standalone, under a minute:
#
#     benchmarks/realgpu_bundle.sh TOOLS OUT [PACKAGE]
#
# TOOLS as benchmarks/realgpu_tools.sh makes it (runc, busybox, lib/); PACKAGE the .deb or the
# tarball of scripts/package (default: the one in .realgpu/bundle/, where the lead carries it).
# The package's files go into a scratch root (dpkg-deb -x, or the tarball's files/: nothing of
# the node is installed or changed), then runc starts a busybox container whose prestart hook is
# that root's nvcontainer-hook, with NVIDIA_VISIBLE_DEVICES=0, and the container runs
# `nvidia-smi -L` (injected by the hook with the driver's libraries). The node's Python (3.12)
# and glibc play no part: the tree brings its own. Writes OUT/bundle.log; exits non-zero unless
# the container listed GPU 0.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(realpath "${1:?usage: benchmarks/realgpu_bundle.sh TOOLS OUT [PACKAGE]}")
out=$(realpath -m "${2:?usage: benchmarks/realgpu_bundle.sh TOOLS OUT [PACKAGE]}")
pkg=${3:-$( (ls .realgpu/bundle/nvcontainer_*_amd64.deb .realgpu/bundle/nvcontainer_*_amd64.tar.gz 2>/dev/null || true) | head -1)}
[ -f "$pkg" ] || { echo "realgpu_bundle: no package (${pkg:-none in .realgpu/bundle/})" >&2; exit 1; }
mkdir -p "$out"
log=$out/bundle.log
exec > >(tee "$log") 2>&1
start=$(date +%s.%N)
work=$(mktemp -d /tmp/nvc-realgpu-bundle.XXXXXX)
runc=("$tools/runc" --root "$work/runc-state")
export LD_LIBRARY_PATH=$tools/lib   # for runc only; the hook's front drops the environment
cleanup() {
    "${runc[@]}" delete -f nvc-bundle >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
echo "== node: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1), python3 $(python3 -V 2>&1)"
echo "== package: $pkg ($(du -h "$pkg" | cut -f1))"
root=$work/root
mkdir -p "$root"
case "$pkg" in
*.deb) dpkg-deb -x "$pkg" "$root" ;;
*.tar.gz) tar -C "$work" -xzf "$pkg" && cp -a "$work"/nvcontainer-*/files/. "$root/" ;;
*) echo "realgpu_bundle: $pkg is neither a .deb nor a .tar.gz" >&2; exit 1 ;;
esac
tree=$root/usr/lib/nvcontainer
"$tree/bin/nvcontainer" --version
"$tree/bin/python3" -c 'import sys, ssl; print("tree python:", sys.version.split()[0], sys.prefix, ssl.OPENSSL_VERSION)'

# busybox and the C runtime nvidia-smi links (what an image would bring); the driver's libraries
# and nvidia-smi itself come from the hook
rootfs=$work/bundle/rootfs
mkdir -p "$rootfs"/{bin,usr/bin,lib64,lib/x86_64-linux-gnu,etc,proc,sys,dev,tmp}
cp "$tools/busybox" "$rootfs/bin/busybox"
for a in sh cat ls; do ln -s busybox "$rootfs/bin/$a"; done
echo /lib/x86_64-linux-gnu > "$rootfs/etc/ld.so.conf"
smi=$(command -v nvidia-smi || true)
[ -x /usr/local/nvidia/bin/nvidia-smi ] && smi=/usr/local/nvidia/bin/nvidia-smi   # /usr/bin/nvidia-smi is a script there
[ -n "$smi" ] || { echo "realgpu_bundle: no nvidia-smi on this node (no driver?)" >&2; exit 1; }
ldd "$smi" | sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^\s*\(\/[^ ]*ld-linux[^ ]*\) .*/\1/p' | grep -v -e nvidia -e libcuda |
while read -r lib; do
    case "$lib" in *ld-linux*) cp -L "$lib" "$rootfs/lib64/" ;; *) cp -L "$lib" "$rootfs/lib/x86_64-linux-gnu/" ;; esac
done
/sbin/ldconfig -r "$rootfs" 2>/dev/null || true

cd "$work/bundle"
"${runc[@]}" spec
python3 - "$tree/bin/nvcontainer-hook" <<'PY'
import json, sys
spec = json.load(open("config.json"))
spec["process"].update(terminal=False, args=["/bin/sh", "-c", "nvidia-smi -L"],
                       env=["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"])
spec["root"] = {"path": "rootfs", "readonly": False}
spec["hooks"] = {"prestart": [{"path": sys.argv[1], "args": ["nvcontainer-hook", "prestart"],
                               "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                               "timeout": 60}]}
spec["linux"]["cgroupsPath"] = "/nvc-real/bundle"
json.dump(spec, open("config.json", "w"))
PY
pivot=()
set +e
got=$("${runc[@]}" run --bundle "$work/bundle" nvc-bundle 2>&1)
rc=$?
if [ $rc != 0 ] && grep -q pivot <<< "$got"; then
    "${runc[@]}" delete -f nvc-bundle >/dev/null 2>&1
    pivot=(--no-pivot)
    got=$("${runc[@]}" run "${pivot[@]}" --bundle "$work/bundle" nvc-bundle 2>&1)
    rc=$?
fi
set -e
echo "== runc run ${pivot[*]} with the package's nvcontainer-hook, NVIDIA_VISIBLE_DEVICES=0: rc=$rc"
echo "$got"
echo "== $(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))") s"
if [ $rc = 0 ] && grep -q '^GPU 0: ' <<< "$got" && ! grep -q '^GPU 1: ' <<< "$got"; then
    echo "realgpu_bundle: PASS (the container listed GPU 0 alone)"
else
    echo "realgpu_bundle: FAIL"
    exit 1
fi
