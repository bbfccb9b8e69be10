#!/bin/bash
# Build libfuse's own C passthrough daemon (example/passthrough_hp: multi-threaded, FUSE
# passthrough for file data) from the libfuse source that deps/passthrough/build.sh (make
# install) unpacked, as a reference for what a FUSE daemon written in C costs here:
#
#   bash bench/c_passthrough.sh            # prints the binary's path
#   python3 bench/smallfiles.py --modes c=$(bash bench/c_passthrough.sh),bare,write-through
#
# Nothing is installed; the build goes to $WORK/examples-build (WORK as in build.sh).
set -euo pipefail
WORK=${WORK:-/var/tmp/pt-build}
SRC=$WORK/fuse-src
OUT=$WORK/examples-build
TOOLS=$(ls -d "$WORK"/tools-py3* 2>/dev/null | head -n 1)
die() { echo "c_passthrough.sh: $*" >&2; exit 1; }
[ -f "$SRC/meson.build" ] || die "no libfuse source in $SRC: run 'make install' first."
[ -n "$TOOLS" ] && PATH=$TOOLS/bin:$PATH
command -v meson >/dev/null || die "meson is missing: run 'make install' first."
command -v g++ >/dev/null || die "g++ is missing (passthrough_hp is C++): apt-get install g++."
if [ ! -x "$OUT/example/passthrough_hp" ]; then
    [ -d "$OUT" ] || meson setup "$OUT" "$SRC" -Dexamples=true -Dutils=false \
        --buildtype=release >"$WORK/examples-build.log" 2>&1 \
        || die "meson setup failed: see $WORK/examples-build.log."
    ninja -C "$OUT" example/passthrough_hp >>"$WORK/examples-build.log" 2>&1 \
        || die "the build failed: see $WORK/examples-build.log."
fi
echo "$OUT/example/passthrough_hp"
