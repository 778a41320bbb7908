#!/usr/bin/env python3
"""Builds the microVM guest's two images from this host's files.

    guest/build-image.py OUT_DIR --kernel VMLINUX --agent BIN --env NAME=DIR [--env NAME=DIR…]

- OUT_DIR/initramfs-<hash>.cpio.gz: the agent (as /init) and the shared libraries it links,
  with /dev/console. The agent mounts the root image and moves into it (guest/agent).
- OUT_DIR/root-<hash>.ext4: the read-only root every VM shares: Debian's Python 3.11 and a
  shell with its tools (the files of the Debian packages in PACKAGES, as installed here),
  each kernelspec's environment (`--env NAME=DIR`, DIR being kernels/NAME/.venv) at
  /opt/cellgate/envs/NAME (the agent binds the one a kernel uses at /opt/cellgate/venv, the
  path the venvs were built for), the Debian packages a kernelspec's `guest-packages` file
  beside its environment names (R for `ir`, with every r-cran-* package they depend on),
  every shared library any of their programs links (the closure, found with ldd), the
  harmless /etc entries every backend shows (src/sandbox/rootfs.rs), and a linker cache made
  for the image itself. Files the environments share byte for byte (python3 and
  python3-lean's numpy, say) are one file, hard-linked.

Each file's <hash> covers everything that goes into it, so a second run with the same inputs
only prints the paths. Writes OUT_DIR/guest.json, the manifest the gateway's microvm backend
reads (kernel, initramfs and root image, by name, and the environments the root holds),
removes the images it no longer names, and prints the manifest. `--venv DIR` is the older
spelling of `--env python3=DIR`.

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

# Where the root image holds the kernelspecs' environments, and where the agent shows the
# one a kernel uses (guest/agent/src/protocol.rs, ENVIRONMENTS_DIR and ENVIRONMENT_AT).
ENVIRONMENTS_DIR = "/opt/cellgate/envs"
ENVIRONMENT_AT = "/opt/cellgate/venv"

# A kernelspec's Debian packages for the guest, beside its environment (kernels/NAME/).
GUEST_PACKAGES = "guest-packages"

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
    "/etc/fonts",
    "/etc/R/Renviron",
    "/etc/R/ldpaths",
]

# /etc files of a kernelspec's packages that the image leaves out: R's site files are where
# hosts keep tokens (only Renviron and ldpaths, in ETC_ENTRIES, are shown, as in every
# backend).
SKIP_ETC_PREFIXES = ("/etc/R/",)

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


def installed(packages):
    """`packages` with their versions, as installed here; stops when one is not."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version} ${Status}\n", *packages],
        capture_output=True, text=True,
    )
    lines = out.stdout.splitlines()
    missing = [p for p in packages if not any(
        l.split(" ")[0].split(":")[0] == p and l.endswith(" installed") for l in lines)]
    if out.returncode != 0 or missing:
        raise SystemExit(f"build-image.py: not installed here: {' '.join(missing) or out.stderr.strip()} "
                         "(./dev setup installs them)")
    return "".join(" ".join(l.split(" ")[:2]) + "\n" for l in lines)


def with_r_dependencies(packages):
    """`packages` and every r-cran-*/r-base-* package they depend on, recursively. Other
    dependencies are libraries (found by ldd) or what PACKAGES holds: a kernelspec names the
    data packages it needs (fonts) itself."""
    closure, pending = [], list(packages)
    while pending:
        name = pending.pop(0)
        if name in closure:
            continue
        closure.append(name)
        depends = subprocess.run(
            ["dpkg-query", "-W", "-f=${Pre-Depends}, ${Depends}", name],
            capture_output=True, text=True, check=True,
        ).stdout
        for alternatives in depends.split(","):
            # The first alternative that is an R package (r-api-* are virtual: r-base-core).
            for choice in alternatives.split("|"):
                dep = choice.strip().split(" ")[0].split(":")[0]
                if re.match(r"r-(cran|base)-", dep) and dep not in closure:
                    pending.append(dep)
                    break
    return closure


def kernel_packages(environments):
    """The Debian packages the environments' kernelspecs name in `guest-packages`."""
    wanted = []
    for _, path in environments:
        listing = os.path.join(os.path.dirname(path), GUEST_PACKAGES)
        if os.path.exists(listing):
            with open(listing) as f:
                for line in f:
                    name = line.split("#")[0].strip()
                    if name and name not in wanted and name not in PACKAGES:
                        wanted.append(name)
    return with_r_dependencies(wanted) if wanted else []


def environment_digest(name, path, digest):
    """Adds what makes environment `name` at `path` what it is to `digest`."""
    digest.update(f"environment {name}\0".encode())
    if os.path.exists(os.path.join(path, "pyvenv.cfg")):
        stamp = os.path.join(path, ".cellgate-stamp")
        if not os.path.exists(stamp):
            raise SystemExit(f"build-image.py: {stamp} missing: run ./dev setup first")
        sha256_file(stamp, digest)
        sha256_file(os.path.join(path, "pyvenv.cfg"), digest)
        # The stamp covers what pip installed; ./dev setup also copies the project's kernel
        # files (cellgate_*.py) into the venv, and a changed one must make a new image too.
        site = os.path.join(path, "lib", "python3*", "site-packages")
        if name == "python3" and not glob.glob(os.path.join(site, "cellgate_kernel_launcher.py")):
            raise SystemExit(f"build-image.py: no cellgate_kernel_launcher.py in {path}: run ./dev setup")
        for own in sorted(glob.glob(os.path.join(site, "cellgate_*.py"))):
            sha256_file(own, digest)
        return
    # Not a venv (Deno's binary and relay, R's start script): small enough to hash whole.
    for dirpath, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            file = os.path.join(dirpath, f)
            digest.update(os.path.relpath(file, path).encode() + b"\0")
            if os.path.islink(file):
                digest.update(os.readlink(file).encode())
            else:
                digest.update(b"%o\0" % os.stat(file).st_mode)
                sha256_file(file, digest)


def link_duplicates(tree):
    """Makes the regular files under `tree` that are byte for byte the same one file (hard
    links; mke2fs -d keeps them), so environments that share packages cost their size once.
    Modes must match too: a link shares them."""
    by_size = {}
    for dirpath, _, files in os.walk(tree):
        for f in files:
            path = os.path.join(dirpath, f)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size >= 1024:
                by_size.setdefault((st.st_size, st.st_mode), []).append(path)
    saved = 0
    for (size, _), paths in by_size.items():
        if len(paths) < 2:
            continue
        first = {}
        for path in paths:
            digest = hashlib.sha256()
            sha256_file(path, digest)
            key = digest.digest()
            if key in first:
                os.unlink(path)
                os.link(first[key], path)
                saved += size
            else:
                first[key] = path
    return saved


def build_root(out_dir, environments):
    digest = script_digest()
    extra = kernel_packages(environments)
    digest.update(installed(PACKAGES).encode())
    digest.update(installed(extra).encode())
    for name, path in environments:
        environment_digest(name, path, digest)
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
        if extra:
            log(f"the kernelspecs' Debian packages: {' '.join(extra)}")
            listing += [
                path for path in subprocess.run(
                    ["dpkg", "-L", *extra], capture_output=True, text=True, check=True
                ).stdout.splitlines()
                if not path.startswith(SKIP_ETC_PREFIXES)
            ]
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
        # Commands Debian names through /etc/alternatives (`which`, which R runs), made by
        # maintainer scripts and so in no package's file list: a direct link to this host's
        # choice, where the image holds it.
        for name in sorted(os.listdir("/usr/bin")):
            host = os.path.join("/usr/bin", name)
            if not os.path.islink(host) or not os.readlink(host).startswith("/etc/alternatives/"):
                continue
            chosen = os.path.realpath(host)
            link = os.path.join(staging, "usr/bin", name)
            if os.path.isfile(os.path.join(staging, chosen.lstrip("/"))) and not os.path.lexists(link):
                os.symlink(chosen, link)
        envs = os.path.join(staging, ENVIRONMENTS_DIR.lstrip("/"))
        for name, path in environments:
            shutil.copytree(path, os.path.join(envs, name), symlinks=True)
        os.makedirs(os.path.join(staging, ENVIRONMENT_AT.lstrip("/")), exist_ok=True)
        saved = link_duplicates(envs)
        log(f"the environments' shared files: {saved >> 20} MiB kept once")

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

        inode_sizes = {}
        for d, _, fs in os.walk(staging):
            for f in fs:
                st = os.lstat(os.path.join(d, f))
                inode_sizes[st.st_ino] = st.st_size
        size = sum(inode_sizes.values())
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
    parser.add_argument("--env", action="append", default=[], metavar="NAME=DIR",
                        help="a kernelspec's environment on this host (kernels/NAME/.venv), "
                             f"built for {ENVIRONMENT_AT}; repeatable")
    parser.add_argument("--venv", help="the python3 kernel's venv (--env python3=DIR)")
    args = parser.parse_args()
    environments = {}
    for spec in args.env + ([f"python3={args.venv}"] if args.venv else []):
        name, _, path = spec.partition("=")
        # The agent's is_environment_name: a kernelspec's directory name.
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}", name) or not path:
            raise SystemExit(f"build-image.py: --env {spec}: want NAME=DIR")
        if not os.path.isdir(path):
            raise SystemExit(f"build-image.py: --env {spec}: no such directory")
        environments[name] = os.path.abspath(path)
    if not environments:
        raise SystemExit("build-image.py: no --env (the image would run no kernel)")
    environments = sorted(environments.items())
    os.makedirs(args.out_dir, exist_ok=True)
    out_dir = os.path.realpath(args.out_dir)
    initramfs = build_initramfs(out_dir, os.path.realpath(args.agent))
    root = build_root(out_dir, environments)
    kernel = os.path.realpath(args.kernel)
    manifest = {
        "kernel": os.path.relpath(kernel, out_dir) if kernel.startswith(out_dir + "/") else kernel,
        "initramfs": os.path.basename(initramfs),
        "root": os.path.basename(root),
        "environments": [name for name, _ in environments],
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
