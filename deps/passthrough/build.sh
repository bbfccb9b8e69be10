#!/usr/bin/env bash
# Build a private libfuse >= 3.17.1 (Debian trixie's fuse3 source package) and pyfuse3 3.5.0
# patched for FUSE passthrough (pyfuse3-passthrough.patch), and install that pyfuse3 into a
# virtualenv or into a given Python. Idempotent: finished steps are skipped.
#
#   deps/passthrough/build.sh [--venv DIR | --python PY] [--prefix DIR] [--work DIR]
#                             [--selftest] [--force]
#
#   --venv DIR    install into this virtualenv; created with `python3 -m venv` if missing
#                 (default: /var/tmp/pt-build/venv)
#   --python PY   install into the environment of interpreter PY instead, e.g.
#                 --python "$(command -v python3)": this REPLACES that environment's pyfuse3
#   --prefix DIR  private libfuse prefix (default: /opt/cachefs-fuse; lib/, include/fuse3/,
#                 lib/pkgconfig/; nothing else is installed, /usr and /etc are not touched)
#   --work DIR    scratch space: apt lists, sources, build trees, wheels, logs and the build-tool
#                 venv (default: /var/tmp/pt-build)
#   --selftest    afterwards mount demo_passthrough.py over a scratch directory and check that a
#                 read is served by passthrough (needs root and Linux >= 6.9)
#   --force       redo every step
#
# Environment: FUSE3_DEB_VERSION pins the Debian source version (e.g. 3.17.2-3); default is
# whatever trixie currently has, which must be upstream 3.17.1 or newer.
# Needs: root (for --prefix under /opt and --selftest), network access to the Debian archive and
# PyPI, gcc, pkg-config, dpkg-source (dpkg-dev), patch, Python >= 3.10 with venv.
# On failure prints one sentence naming the failed step and its log, and exits non-zero.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=/var/tmp/pt-build/venv
TARGET_PY=
PREFIX=/opt/cachefs-fuse
WORK=/var/tmp/pt-build
SELFTEST=0
FORCE=0
PYFUSE3_VERSION=3.5.0
PYFUSE3_SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
FUSE3_MIN=3.17.1
# Applied in this order: FUSE passthrough, then taking queued requests without a scheduler pass,
# then FUSE_CAP_HANDLE_KILLPRIV_V2 (needs the libfuse patch: the kernel's kill-suid/sgid flags),
# then FUSE_CAP_DONT_MASK with POSIX ACLs (default ACLs replace the umask), then the
# fallocate and lseek (SEEK_DATA/SEEK_HOLE) operations, then the C read hook (cache hits
# answered without a coroutine: cachefs/_hit.c).
PATCHES=("$HERE/pyfuse3-passthrough.patch" "$HERE/pyfuse3-queued-requests.patch"
         "$HERE/pyfuse3-kill-suidgid.patch" "$HERE/pyfuse3-acl-dont-mask.patch"
         "$HERE/pyfuse3-fallocate.patch" "$HERE/pyfuse3-lseek.patch"
         "$HERE/pyfuse3-read-hook.patch" "$HERE/pyfuse3-direct-io-mmap.patch")
LIBFUSE_PATCHES=("$HERE/libfuse-kill-suidgid.patch")
REQS=$HERE/build-requirements.txt

die() { echo "build.sh: $*" >&2; exit 1; }
say() { echo "build.sh: $*"; }

while [ $# -gt 0 ]; do
    case $1 in
        --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
        --python) TARGET_PY=${2:?--python needs an interpreter}; VENV=; shift 2 ;;
        --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
        --work) WORK=${2:?--work needs a directory}; shift 2 ;;
        --selftest) SELFTEST=1; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)." ;;
    esac
done
case $PREFIX in /*) ;; *) die "--prefix must be an absolute path, not '$PREFIX'." ;; esac
mkdir -p "$WORK/logs" || die "cannot create the work directory $WORK."
WORK=$(cd "$WORK" && pwd)

# step NAME CMD...: run CMD with its output in $WORK/logs/NAME.log; one sentence on failure
step() {
    local name=$1; shift
    if ! "$@" > "$WORK/logs/$name.log" 2>&1; then
        die "step '$name' failed ($(tail -n 1 "$WORK/logs/$name.log" | cut -c1-160)); full log: $WORK/logs/$name.log."
    fi
}
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]; }

# ---------------------------------------------------------------- prerequisites
for tool in gcc pkg-config apt-get dpkg-source patch sha256sum; do
    command -v "$tool" > /dev/null || die "'$tool' is missing (apt-get install gcc pkg-config dpkg-dev patch)."
done
[ -r /usr/share/keyrings/debian-archive-keyring.gpg ] \
    || die "/usr/share/keyrings/debian-archive-keyring.gpg is missing (apt-get install debian-archive-keyring)."
for p in "${PATCHES[@]}" "${LIBFUSE_PATCHES[@]}"; do [ -r "$p" ] || die "the patch $p is missing."; done

if [ -n "$VENV" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        command -v python3 > /dev/null || die "python3 is missing, cannot create the venv $VENV."
        step venv python3 -m venv "$VENV"
        say "created venv $VENV"
    fi
    TARGET_PY=$VENV/bin/python
fi
if [ ! -x "$TARGET_PY" ]; then
    FOUND=$(command -v "$TARGET_PY") || die "the interpreter '$TARGET_PY' does not exist."
    TARGET_PY=$FOUND
fi
PYVER=$("$TARGET_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
    || die "cannot run $TARGET_PY."
version_ge "$PYVER" 3.10 || die "pyfuse3 $PYFUSE3_VERSION needs Python >= 3.10, $TARGET_PY is $PYVER."
"$TARGET_PY" -m pip --version > /dev/null 2>&1 || die "$TARGET_PY has no pip (python3 -m ensurepip)."

# ---------------------------------------------------------------- build tools (private venv)
# Created from the target interpreter so that the wheel matches its ABI.
TOOLS=$WORK/tools-py$PYVER
REQS_HASH=$(sha256sum "$REQS" | cut -c1-16)
if [ $FORCE = 1 ] || [ "$(cat "$TOOLS/.stamp" 2>/dev/null)" != "$REQS_HASH $("$TARGET_PY" -c 'import sys; print(sys.version)' | head -n 1)" ]; then
    rm -rf "$TOOLS"
    step tools-venv "$TARGET_PY" -m venv "$TOOLS"
    step tools-pip "$TOOLS/bin/python" -m pip install --upgrade pip
    step tools-install "$TOOLS/bin/python" -m pip install -r "$REQS"
    echo "$REQS_HASH $("$TARGET_PY" -c 'import sys; print(sys.version)' | head -n 1)" > "$TOOLS/.stamp"
    say "build tools installed in $TOOLS"
else
    say "build tools already in $TOOLS"
fi
export PATH=$TOOLS/bin:$PATH

# ---------------------------------------------------------------- libfuse source (trixie)
# A private apt configuration: the system's sources, lists and cache are left alone.
APT=(-o Dir::Etc::sourcelist="$WORK/apt/sources.list" -o Dir::Etc::sourceparts=-
     -o Dir::State::Lists="$WORK/apt/lists" -o Dir::Cache="$WORK/apt/cache"
     -o APT::Sandbox::User=root)
SRCDIR=$(cat "$WORK/src/.fuse3-dir" 2>/dev/null)
if [ $FORCE = 1 ] || [ -z "$SRCDIR" ] || [ ! -f "$SRCDIR/meson.build" ] \
   || { [ -n "${FUSE3_DEB_VERSION:-}" ] && [ "$(cat "$WORK/src/.fuse3-deb-version" 2>/dev/null)" != "$FUSE3_DEB_VERSION" ]; }; then
    mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial"
    # The Debian archive the system's apt already uses (its bookworm main), for trixie.
    MIRROR=$(apt-cache policy | awk '$3 ~ /^bookworm\/main$/ {print $2; exit}')
    [ -n "$MIRROR" ] || die "no Debian bookworm main archive in the system's apt sources (run apt-get update)."
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" \
        > "$WORK/apt/sources.list"
    step apt-update apt-get "${APT[@]}" update
    rm -rf "$WORK/src"; mkdir -p "$WORK/src"
    step apt-source bash -c 'cd "$1" && shift && apt-get "$@"' _ "$WORK/src" "${APT[@]}" source \
        "fuse3${FUSE3_DEB_VERSION:+=$FUSE3_DEB_VERSION}"
    SRCDIR=$(ls -d "$WORK"/src/fuse3-*/ 2>/dev/null | head -n 1)
    [ -n "$SRCDIR" ] || die "apt-get source fuse3 did not unpack a fuse3-* directory in $WORK/src."
    SRCDIR=${SRCDIR%/}
    basename "$(ls "$WORK"/src/fuse3_*.dsc)" .dsc | sed 's/^fuse3_//' > "$WORK/src/.fuse3-deb-version"
    echo "$SRCDIR" > "$WORK/src/.fuse3-dir"
    say "fetched fuse3 $(cat "$WORK/src/.fuse3-deb-version") source into $SRCDIR"
else
    say "fuse3 $(cat "$WORK/src/.fuse3-deb-version") source already in $SRCDIR"
fi
FUSE3_VERSION=$(sed -n "s/^ *version: *'\([0-9.]*\)'.*/\1/p" "$SRCDIR/meson.build" | head -n 1)
DEB_VERSION=$(cat "$WORK/src/.fuse3-deb-version")
version_ge "$FUSE3_VERSION" "$FUSE3_MIN" \
    || die "trixie's fuse3 is $FUSE3_VERSION, but $FUSE3_MIN or newer is needed (set FUSE3_DEB_VERSION)."

# ---------------------------------------------------------------- libfuse build + install
MESON_OPTS=(--prefix="$PREFIX" --libdir=lib --buildtype=release -Dexamples=false -Dutils=false
            -Dtests=false -Dinitscriptdir= -Duseroot=false -Dudevrulesdir="$PREFIX/etc/udev/rules.d")
FUSE_STAMP="fuse3 $DEB_VERSION ${MESON_OPTS[*]} patches $(cat "${LIBFUSE_PATCHES[@]}" | sha256sum | cut -c1-8)"
if [ $FORCE = 1 ] || [ "$(cat "$PREFIX/.cachefs-fuse-stamp" 2>/dev/null)" != "$FUSE_STAMP" ] \
   || [ ! -e "$PREFIX/lib/libfuse3.so.$FUSE3_VERSION" ] || [ ! -e "$PREFIX/lib/pkgconfig/fuse3.pc" ]; then
    rm -rf "$WORK/fuse-build" "$WORK/fuse-src"
    cp -a "$SRCDIR" "$WORK/fuse-src" || die "cannot copy the fuse3 source to $WORK/fuse-src."
    for p in "${LIBFUSE_PATCHES[@]}"; do
        step "patch-$(basename "$p" .patch)" patch -d "$WORK/fuse-src" -p1 --forward --input="$p"
    done
    step meson-setup meson setup "$WORK/fuse-build" "$WORK/fuse-src" "${MESON_OPTS[@]}"
    step ninja ninja -C "$WORK/fuse-build"
    mkdir -p "$PREFIX" || die "cannot create $PREFIX (run as root or pass --prefix)."
    rm -rf "$PREFIX"/lib/libfuse3.so* "$PREFIX/include/fuse3" "$PREFIX/lib/pkgconfig/fuse3.pc" "$PREFIX/.cachefs-fuse-stamp"
    step meson-install meson install -C "$WORK/fuse-build"
    echo "$FUSE_STAMP" > "$PREFIX/.cachefs-fuse-stamp"
    rm -rf "$WORK/wheels"                                   # built against the old library
    say "installed libfuse $FUSE3_VERSION into $PREFIX"
else
    say "libfuse $FUSE3_VERSION already installed in $PREFIX"
fi
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig
GOT=$(pkg-config --modversion fuse3 2>/dev/null) || die "pkg-config finds no fuse3 in $PKG_CONFIG_PATH."
[ "$GOT" = "$FUSE3_VERSION" ] || die "pkg-config reports fuse3 $GOT in $PREFIX, expected $FUSE3_VERSION."

# ---------------------------------------------------------------- pyfuse3 sdist
SDIST=$WORK/sdist/pyfuse3-$PYFUSE3_VERSION.tar.gz
if [ ! -f "$SDIST" ] || [ "$(sha256sum < "$SDIST" | cut -d' ' -f1)" != "$PYFUSE3_SHA256" ]; then
    rm -f "$SDIST"
    # --no-build-isolation: the metadata step uses the tools venv's setuptools and Cython;
    # with isolation, --no-binary :all: would build Cython itself from source (~5 min).
    step pip-download "$TOOLS/bin/python" -m pip download --no-deps --no-binary :all: \
        --no-build-isolation \
        "pyfuse3==$PYFUSE3_VERSION" -d "$WORK/sdist"
    [ "$(sha256sum < "$SDIST" | cut -d' ' -f1)" = "$PYFUSE3_SHA256" ] \
        || die "the pyfuse3 $PYFUSE3_VERSION sdist from PyPI does not have the expected sha256 $PYFUSE3_SHA256."
    say "downloaded $SDIST"
fi

# ---------------------------------------------------------------- patched pyfuse3 wheel
# The local version label ties the wheel to the patches (libfuse's too: the wheel uses its
# headers): 3.5.0+pt<sha256 of them, 8 hex>.
PT_VERSION=$PYFUSE3_VERSION+pt$(cat "${PATCHES[@]}" "${LIBFUSE_PATCHES[@]}" | sha256sum | cut -c1-8)
WHEEL=$(ls "$WORK"/wheels/pyfuse3-"${PT_VERSION}"-cp"${PYVER/./}"-*.whl 2>/dev/null | head -n 1)
if [ $FORCE = 1 ] || [ -z "$WHEEL" ]; then
    rm -rf "$WORK/pyfuse3-src" "$WORK/wheels"; mkdir -p "$WORK/pyfuse3-src" "$WORK/wheels"
    step unpack-sdist tar xzf "$SDIST" -C "$WORK/pyfuse3-src" --strip-components=1
    for p in "${PATCHES[@]}"; do
        step "patch-$(basename "$p" .patch)" patch -d "$WORK/pyfuse3-src" -p1 --forward --input="$p"
    done
    rm -f "$WORK/pyfuse3-src/src/pyfuse3/__init__.c"          # force Cython to regenerate it
    step pyfuse3-wheel env SETUPTOOLS_SCM_PRETEND_VERSION="$PT_VERSION" \
        LDFLAGS="-Wl,-rpath,$PREFIX/lib ${LDFLAGS:-}" \
        "$TOOLS/bin/python" -m pip wheel -v --no-build-isolation --no-deps "$WORK/pyfuse3-src" -w "$WORK/wheels"
    WHEEL=$(ls "$WORK"/wheels/pyfuse3-"${PT_VERSION}"-cp"${PYVER/./}"-*.whl 2>/dev/null | head -n 1)
    [ -n "$WHEEL" ] || die "pip wheel did not produce pyfuse3-$PT_VERSION for Python $PYVER in $WORK/wheels."
    say "built $WHEEL"
else
    say "wheel already built: $WHEEL"
fi

# ---------------------------------------------------------------- install into the target
installed_ok() {
    "$TARGET_PY" - "$PT_VERSION" "$PREFIX" <<'EOF'
import importlib.metadata as md, subprocess, sys
want, prefix = sys.argv[1:]
if md.version('pyfuse3') != want:
    sys.exit(1)
import pyfuse3
out = subprocess.run(['ldd', pyfuse3.__file__], capture_output=True, text=True).stdout
sys.exit(0 if f'{prefix}/lib/libfuse3.so' in out and hasattr(pyfuse3, 'passthrough_open') else 1)
EOF
}
if [ $FORCE = 1 ] || ! installed_ok > /dev/null 2>&1; then
    step pip-install "$TARGET_PY" -m pip install --no-deps --force-reinstall "$WHEEL"
    "$TARGET_PY" -c 'import trio' > /dev/null 2>&1 || step pip-install-trio "$TARGET_PY" -m pip install 'trio>=0.15'
    installed_ok > "$WORK/logs/verify.log" 2>&1 \
        || die "pyfuse3 $PT_VERSION was installed into $TARGET_PY but does not import or does not load $PREFIX/lib/libfuse3.so (see $WORK/logs/verify.log)."
    say "installed pyfuse3 $PT_VERSION into $("$TARGET_PY" -c 'import sys; print(sys.prefix)')"
else
    say "pyfuse3 $PT_VERSION already installed for $TARGET_PY"
fi

# ---------------------------------------------------------------- optional self-test
if [ $SELFTEST = 1 ]; then
    [ "$(id -u)" = 0 ] || die "--selftest needs root (FUSE passthrough needs CAP_SYS_ADMIN)."
    T=$(mktemp -d "$WORK/selftest.XXXXXX")
    mkdir "$T/src" "$T/mnt"; echo "passthrough selftest" > "$T/src/hello"
    "$TARGET_PY" "$HERE/demo_passthrough.py" "$T/src" "$T/mnt" > "$T/stats.json" 2> "$T/daemon.err" &
    DPID=$!
    for _ in $(seq 100); do mountpoint -q "$T/mnt" && break; sleep 0.05; done
    GOTTEXT=$(cat "$T/mnt/hello" 2>&1)
    mountpoint -q "$T/mnt" && fusermount3 -u "$T/mnt"
    wait "$DPID"
    if [ "$GOTTEXT" != "passthrough selftest" ] \
       || ! "$TARGET_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(not (d["passthrough_enabled"] and d["passthrough_open"] == 1 and d["read"] == 0))' "$T/stats.json" 2> /dev/null; then
        die "the self-test failed: read '$GOTTEXT', daemon stats $(cat "$T/stats.json" 2>/dev/null) (daemon log: $T/daemon.err)."
    fi
    rm -rf "$T"
    say "self-test passed: a file was read through FUSE passthrough with 0 READ requests at the daemon"
fi

say "done: pyfuse3 $PT_VERSION with FUSE passthrough, linked against libfuse $FUSE3_VERSION (Debian $DEB_VERSION) in $PREFIX, installed for $TARGET_PY."
