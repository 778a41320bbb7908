#!/usr/bin/env bash
# Builds what tests/it/cgroup_v2.rs boots: Debian's own kernel (vmlinuz) and a small
# initramfs (busybox-static, the virtio/9p/overlay modules that kernel has as modules, and
# tests/cgroupv2/init), in target/cgroupv2/ or $1. Both packages are fetched with
# `apt-get download` and unpacked there with dpkg-deb: nothing is installed on the host.
# Idempotent: with the same package versions already built, it only checks and returns.
#
# Why Debian's kernel rather than the microVM guest's (guest/): that one is built without
# user, pid and network namespaces, which the namespaces backend needs; building a second
# kernel would cost CI ~15 minutes. The generic image, not -cloud: only it has 9p.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)"
OUT="${1:-$ROOT/target/cgroupv2}"
mkdir -p "$OUT/debs"
OUT="$(cd "$OUT" && pwd -P)"

# The versioned image the meta-package stands for (linux-image-6.1.0-N-amd64 on bookworm).
image="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')"
[ -n "$image" ] || {
  echo "prepare.sh: apt-cache knows no linux-image-amd64 (run apt-get update)" >&2
  exit 1
}
version="$(apt-cache policy "$image" | awk '/Candidate:/ {print $2}')"
bb_version="$(apt-cache policy busybox-static | awk '/Candidate:/ {print $2}')"
want="$image $version busybox-static $bb_version $(sha256sum "$ROOT/tests/cgroupv2/init" | cut -c1-16)"
if [ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$want" ] && [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initramfs.cpio.gz" ]; then
  exit 0
fi

cd "$OUT/debs"
rm -f ./*.deb
# apt-get download as root warns that _apt cannot write here; the download is the same.
apt-get download -q "$image=$version" "busybox-static=$bb_version" 2> >(grep -v '^W: Download is performed unsandboxed' >&2)
rm -rf "$OUT/unpacked" "$OUT/initramfs"
mkdir -p "$OUT/unpacked"
for deb in ./*.deb; do dpkg-deb -x "$deb" "$OUT/unpacked"; done
kver="${image#linux-image-}"
modules="$OUT/unpacked/lib/modules/$kver/kernel"
cp "$OUT/unpacked/boot/vmlinuz-$kver" "$OUT/vmlinuz.new"

# The initramfs: /init, busybox, and the modules in the order init loads them (each after
# what it depends on: `strings X.ko | grep ^depends=`).
ram="$OUT/initramfs"
mkdir -p "$ram/bin" "$ram/modules"
cp "$OUT/unpacked/bin/busybox" "$ram/bin/busybox"
cp "$ROOT/tests/cgroupv2/init" "$ram/init"
chmod 755 "$ram/init" "$ram/bin/busybox"
for ko in drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_pci_modern_dev \
  drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci net/9p/9pnet net/9p/9pnet_virtio \
  fs/netfs/netfs fs/fscache/fscache fs/9p/9p fs/overlayfs/overlay; do
  cp "$modules/$ko.ko" "$ram/modules/"
done
(cd "$ram" && find . | "$ram/bin/busybox" cpio -o -H newc 2>/dev/null) | gzip -1 >"$OUT/initramfs.cpio.gz.new"
mv "$OUT/vmlinuz.new" "$OUT/vmlinuz"
mv "$OUT/initramfs.cpio.gz.new" "$OUT/initramfs.cpio.gz"
rm -rf "$OUT/unpacked" "$ram"
echo "$want" >"$OUT/stamp"
echo "prepare.sh: $OUT/vmlinuz ($image $version) and $OUT/initramfs.cpio.gz" >&2
