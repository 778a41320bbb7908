#!/usr/bin/env python3
"""Builds the microVM guest's two images from this host's files.

    guest/build-image.py OUT_DIR --kernel VMLINUX --agent BIN --venv DIR [--venv-at PATH]

- OUT_DIR/initramfs-<hash>.cpio.gz: the agent (as /init) and the shared libraries it links,
  with /dev/console. The agent mounts the root image and moves into it (guest/agent).
- OUT_DIR/root-<hash>.ext4: the read-only root every VM shares: Debian's Python 3.11 and a
  shell with its tools (the files of the Debian packages in PACKAGES, as installed here),
  the kernel's venv at the path it was built for, every shared library any of their programs
  links (the closure, found with ldd), the harmless /etc entries every backend shows
  (src/sandbox/rootfs.rs), and a linker cache made for the image itself.

Each file's <hash> covers everything that goes into it, so a second run with the same inputs
only prints the paths. Writes OUT_DIR/guest.json, the manifest the gateway's microvm backend
reads (kernel, initramfs and root image, by name), removes the images it no longer names,
and prints the manifest.

Why this and not debootstrap: the image must hold exactly the interpreter the kernel venv was
built with (its compiled files name its paths), and this host has it; the whole build needs
no download, no root mount and no loop device (mke2fs -d writes the file system from a
folder).
"""

import argparse
import gzip
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile

# The Debian packages whose files the root image holds.
PACKAGES = [
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "dash",
    "coreutils",
    "grep",
    "sed",
    "findutils",
    "ca-certificates",
]

# Debian's package contents that no program reads.
SKIP_PREFIXES = ("/usr/share/doc/", "/usr/share/man/", "/usr/share/info/", "/usr/share/lintian/")

# The harmless host /etc entries (keep in step with ETC_ENTRIES in src/sandbox/rootfs.rs).
ETC_ENTRIES = [
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates.conf",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/mime.types",
    "/etc/os-release",
    "/etc/debian_version",
    "/etc/protocols",
    "/etc/services",
    "/etc/gai.conf",
    "/etc/host.conf",
    "/etc/inputrc",
    "/etc/locale.alias",
]

# Top-level merged-/usr links, as Debian bookworm has them.
USR_LINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}

# Empty directories the agent mounts on, or the kernel expects.
MOUNT_POINTS = ["proc", "sys", "dev", "run", "tmp", "home", "root", "etc", "opt"]


def log(message):
    print(f"build-image.py: {message}", file=sys.stderr, flush=True)


def sha256_file(path, digest):
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def script_digest():
    digest = hashlib.sha256()
    sha256_file(os.path.abspath(__file__), digest)
    return digest


def is_elf(path):
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def linked_libraries(path, bundled=frozenset()):
    """The shared libraries `path` links, as absolute host paths (ldd). A name in `bundled`
    that ldd cannot find is one a wheel ships beside its own libraries (`*.libs`), found at
    run time through the RPATH of the extension that loads it, not through this file's."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True)
    if out.returncode != 0:
        return []  # static, or not a program of this architecture
    libs = []
    for line in out.stdout.splitlines():
        found = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s+(/\S+)\s+\(", line)
        if found:
            libs.append(found.group(1))
        elif "not found" in line and line.split()[0] not in bundled:
            raise SystemExit(f"build-image.py: {path}: {line.strip()}")
    return libs


def host_real_dir(path):
    """`path` with its directory resolved on the host (/lib/x -> /usr/lib/x)."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def copy_into(root, host_path, at=None):
    """Copies one host file, link or directory to the same place (or `at`) under `root`."""
    at = at or host_real_dir(host_path)
    target = os.path.join(root, at.lstrip("/"))
    if os.path.lexists(target):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(host_path):
        os.symlink(os.readlink(host_path), target)
    elif os.path.isdir(host_path):
        os.makedirs(target, exist_ok=True)
        shutil.copystat(host_path, target)
    else:
        shutil.copy2(host_path, target)


def build_root(out_dir, venv, venv_at):
    digest = script_digest()
    versions = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version}\n", *PACKAGES],
        capture_output=True, text=True, check=True,
    ).stdout
    digest.update(versions.encode())
    digest.update(venv_at.encode())
    stamp = os.path.join(venv, ".cellgate-stamp")
    if not os.path.exists(stamp):
        raise SystemExit(f"build-image.py: {stamp} missing: run ./dev setup first")
    sha256_file(stamp, digest)
    sha256_file(os.path.join(venv, "pyvenv.cfg"), digest)
    # The stamp covers what pip installed; ./dev setup also copies the project's kernel
    # launcher and display extension (cellgate_*.py) into the venv, and a changed one must
    # make a new image too.
    site = os.path.join(venv, "lib", "python3*", "site-packages")
    if not glob.glob(os.path.join(site, "cellgate_kernel_launcher.py")):
        raise SystemExit(f"build-image.py: no cellgate_kernel_launcher.py in {venv}: run ./dev setup")
    for own in sorted(glob.glob(os.path.join(site, "cellgate_*.py"))):
        sha256_file(own, digest)
    result = os.path.join(out_dir, f"root-{digest.hexdigest()[:16]}.ext4")
    if os.path.exists(result):
        return result

    log("collecting the root image's files")
    staging = tempfile.mkdtemp(prefix="root-", dir=out_dir)
    try:
        for name in MOUNT_POINTS:
            os.makedirs(os.path.join(staging, name), exist_ok=True)
        os.chmod(os.path.join(staging, "tmp"), 0o1777)
        for link, to in USR_LINKS.items():
            os.makedirs(os.path.join(staging, to), exist_ok=True)
            os.symlink(to, os.path.join(staging, link))
        listing = subprocess.run(
            ["dpkg", "-L", *PACKAGES], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        for path in listing:
            if not path.startswith("/") or path.startswith(SKIP_PREFIXES) or path == "/.":
                continue
            if os.path.lexists(path) and not os.path.isdir(path) or os.path.islink(path):
                copy_into(staging, path)
        for entry in ETC_ENTRIES:
            if not os.path.lexists(entry):
                continue
            if os.path.isdir(entry) and not os.path.islink(entry):
                for dirpath, _, files in os.walk(entry):
                    for f in files:
                        copy_into(staging, os.path.join(dirpath, f), os.path.join(dirpath, f))
            else:
                copy_into(staging, entry, entry)
        # /bin/sh and python3, as every Debian system names them.
        for link, to in [("usr/bin/sh", "dash"), ("usr/bin/python3", "python3.11")]:
            if not os.path.lexists(os.path.join(staging, link)):
                os.symlink(to, os.path.join(staging, link))
        venv_target = os.path.join(staging, venv_at.lstrip("/"))
        os.makedirs(os.path.dirname(venv_target), exist_ok=True)
        shutil.copytree(venv, venv_target, symlinks=True)

        log("finding the shared libraries the programs link")
        seen = set()
        pending = []
        names = set()
        for dirpath, _, files in os.walk(staging):
            names.update(files)
            for f in files:
                path = os.path.join(dirpath, f)
                if not os.path.islink(path) and is_elf(path):
                    pending.append(path)
        names = frozenset(names)
        while pending:
            path = pending.pop()
            for lib in linked_libraries(path, names):
                if lib in seen:
                    continue
                seen.add(lib)
                if lib.startswith(staging):
                    continue
                in_image = os.path.join(staging, host_real_dir(lib).lstrip("/"))
                if not os.path.lexists(in_image):
                    os.makedirs(os.path.dirname(in_image), exist_ok=True)
                    shutil.copy2(os.path.realpath(lib), in_image)
                    pending.append(in_image)
        with open(os.path.join(staging, "etc/ld.so.conf"), "w") as f:
            f.write("/usr/local/lib\n/usr/lib/x86_64-linux-gnu\n")
        subprocess.run(["ldconfig", "-r", staging], check=True)

        size = sum(
            os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(staging) for f in fs
        )
        inodes = sum(len(fs) + len(ds) for _, ds, fs in os.walk(staging))
        size_mb = size * 13 // 10 // (1 << 20) + 64
        log(f"writing the ext4 image ({size >> 20} MiB of files, {inodes} inodes)")
        tmp = result + ".tmp"
        subprocess.run(
            ["mke2fs", "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-m", "0",
             "-N", str(inodes + inodes // 5 + 1024), "-L", "cellgate-root",
             "-E", "root_owner=0:0", "-d", staging, tmp, f"{size_mb}M"],
            check=True,
        )
        os.replace(tmp, result)
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cpio_entry(name, mode, data=b"", rdev=(0, 0), ino=[0]):
    ino[0] += 1
    name_bytes = name.encode() + b"\0"
    fields = [ino[0], mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name_bytes), 0]
    header = b"070701" + b"".join(b"%08x" % f for f in fields)
    pad = lambda n: b"\0" * (-n % 4)
    return header + name_bytes + pad(len(header) + len(name_bytes)) + data + pad(len(data))


def build_initramfs(out_dir, agent):
    digest = script_digest()
    sha256_file(agent, digest)
    libs = linked_libraries(agent)
    for lib in libs:
        sha256_file(lib, digest)
    result = os.path.join(out_dir, f"initramfs-{digest.hexdigest()[:16]}.cpio.gz")
    if os.path.exists(result):
        return result
    log("writing the initramfs")
    stripped = tempfile.NamedTemporaryFile(dir=out_dir, delete=False)
    try:
        subprocess.run(["strip", "-o", stripped.name, agent], check=True)
        with open(stripped.name, "rb") as f:
            agent_bytes = f.read()
    finally:
        os.unlink(stripped.name)
    entries = []
    dirs = {"dev"}
    for lib in libs:
        parts = lib.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    for d in sorted(dirs):
        entries.append(cpio_entry(d, stat.S_IFDIR | 0o755))
    entries.append(cpio_entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    entries.append(cpio_entry("init", stat.S_IFREG | 0o755, agent_bytes))
    for lib in libs:
        with open(os.path.realpath(lib), "rb") as f:
            entries.append(cpio_entry(lib.strip("/"), stat.S_IFREG | 0o755, f.read()))
    entries.append(cpio_entry("TRAILER!!!", 0))
    tmp = result + ".tmp"
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        f.write(b"".join(entries))
    os.replace(tmp, result)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--kernel", required=True, help="the guest kernel (vmlinux)")
    parser.add_argument("--agent", required=True, help="the cellgate-agent binary")
    parser.add_argument("--venv", required=True, help="the kernel venv on this host")
    parser.add_argument("--venv-at", default="/opt/cellgate/venv",
                        help="where the venv was built, and so where the guest has it")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    out_dir = os.path.realpath(args.out_dir)
    initramfs = build_initramfs(out_dir, os.path.realpath(args.agent))
    root = build_root(out_dir, os.path.realpath(args.venv), args.venv_at)
    kernel = os.path.realpath(args.kernel)
    manifest = {
        "kernel": os.path.relpath(kernel, out_dir) if kernel.startswith(out_dir + "/") else kernel,
        "initramfs": os.path.basename(initramfs),
        "root": os.path.basename(root),
    }
    tmp = os.path.join(out_dir, "guest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "guest.json"))
    keep = {os.path.basename(p) for p in (kernel, initramfs, root)}
    for name in os.listdir(out_dir):
        stale = re.match(r"(vmlinux-|initramfs-|root-)[0-9a-f]{16}", name) and name not in keep
        if stale or name.startswith("root-") and not name.endswith(".ext4"):
            path = os.path.join(out_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
