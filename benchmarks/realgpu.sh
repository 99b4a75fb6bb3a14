#!/usr/bin/env bash
# Runs benchmarks/realgpu.py on a bare GPU node, as root, from the repository root:
#
#     benchmarks/realgpu.sh TOOLS OUT [--runs N] [--only STEPS]   (steps: realgpu.py --help)
#
# TOOLS is a directory with what such a node lacks: runc and a static busybox, the shared
# libraries runc and NVIDIA's cli need (lib/), NVIDIA's tools to compare with
# (nvidia-anchors.tar.xz, from ../shared/anchors; the shim that drops the one option the 1.17.9
# hook passes and the 1.17.0 cli does not know is built here, as benchmarks/nvidia.py builds it)
# and wheels of the Python dependencies the node's python3 lacks (whl/), or python-prctl's sdist
# (sdist/, built here): benchmarks/realgpu_tools.sh TOOLS makes it on a Debian 12 machine.
# nvcontainer itself is installed from this checkout, as a regular (non-editable) install into a virtual environment
# that also sees the node's python3 packages; its native fronts and hook client are built with
# the node's compiler.
# Everything goes under /tmp/nvc-real, removed first; OUT receives realgpu.json and realgpu.txt
# (both end with issue 27's targets 1 to 3, judged against NVIDIA's arm of the same run).
set -u
tools=$1 out=$2
shift 2
work=/tmp/nvc-real
rm -rf "$work" && mkdir -p "$work" && cp -a "$tools" "$work/tools" || exit 1
python=$(command -v python3)
"$python" -m venv --without-pip "$work/venv" || exit 1
node_site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# python-prctl has no wheel on PyPI: build one from its sdist with the node's compiler and the
# carried libcap header (benchmarks/realgpu_tools.sh), unless TOOLS brought one
if ! ls "$work"/tools/whl/python_prctl-*.whl >/dev/null 2>&1 && ls "$work"/tools/sdist/python-prctl-*.tar.gz >/dev/null 2>&1; then
    CPATH="$work/tools/inc" LIBRARY_PATH="$work/tools/lib" "$python" -m pip wheel -q --no-deps \
        --no-build-isolation -w "$work/tools/whl" "$work"/tools/sdist/python-prctl-*.tar.gz || exit 1
fi
echo "$node_site" > "$venv_site/node-packages.pth"
"$work/venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation \
    "$work"/tools/whl/*.whl . || exit 1
if ! "$work/venv/bin/python" -c 'import prctl' 2>/dev/null; then
    # python-prctl's wheel was built against libcap 2: give the node the library if it lacks it
    cp "$work/tools/lib/libcap.so.2" /usr/lib/x86_64-linux-gnu/ && ldconfig
fi
exec "$work/venv/bin/python" -m benchmarks.realgpu --work "$work/work" --tools "$work/tools" \
    --venv "$work/venv" --out "$out" "$@"
