#!/usr/bin/env bash
# Builds the microVM guest kernel: Debian's linux-source-6.12 (an apt package, so
# the build needs no download but Debian's own), `make tinyconfig`, then the
# options in guest/kernel.config. Prints the path of the built `vmlinux`.
#
#   guest/build-kernel.sh OUT_DIR
#
# OUT_DIR/vmlinux-<hash> is the result, where <hash> covers everything the build
# reads (this script, the config fragment, the source package's version), so a
# second run with the same inputs returns at once. Takes ~4 min with two cores.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
out="${1:?usage: build-kernel.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd -P)"

tarball=/usr/src/linux-source-6.12.tar.xz
[ -f "$tarball" ] || { echo "build-kernel.sh: $tarball missing: apt-get install linux-source-6.12" >&2; exit 1; }
version="$(dpkg-query -W -f='${Version}' linux-source-6.12 2>/dev/null || stat -c %s-%Y "$tarball")"
hash="$( (cat "$here/build-kernel.sh" "$here/kernel.config"; echo "$version") | sha256sum | cut -c1-16)"
result="$out/vmlinux-$hash"
if [ -f "$result" ]; then
  echo "$result"
  exit 0
fi

work="$out/linux-build-$hash"
rm -rf "$work"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
echo "build-kernel.sh: unpacking $tarball" >&2
tar -xJf "$tarball" -C "$work" --strip-components=1
cd "$work"
make -s tinyconfig
# merge_config.sh -m merges the fragment without running olddefconfig's
# interactive step; the olddefconfig after it resolves dependencies.
./scripts/kconfig/merge_config.sh -m -O . .config "$here/kernel.config" >/dev/null
make -s olddefconfig
# Every option the fragment sets must have stuck: one whose dependency is missing is
# dropped silently by olddefconfig.
missing="$(while IFS= read -r line; do
  case "$line" in
    CONFIG_*) grep -qx "$line" .config || echo "$line" ;;
    "# CONFIG_"*" is not set")
      option="${line#\# }"
      option="${option%% is not set}"
      grep -q "^$option=" .config && echo "$line" ;;
  esac
done <"$here/kernel.config")"
if [ -n "$missing" ]; then
  echo "build-kernel.sh: options the kernel did not take (a dependency is missing):" >&2
  echo "$missing" >&2
  exit 1
fi
echo "build-kernel.sh: make vmlinux -j$(nproc) (about 4 min on two cores)" >&2
start=$SECONDS
nice -n 10 make -s -j"$(nproc)" vmlinux >"$out/kernel-build.log" 2>&1 || {
  tail -30 "$out/kernel-build.log" >&2
  exit 1
}
echo "build-kernel.sh: built in $((SECONDS - start)) s" >&2
cp vmlinux "$result.tmp"
mv "$result.tmp" "$result"
echo "$result"
