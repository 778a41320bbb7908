//! What a VMM sees of the host's files: a root of its own, holding only what it needs.
//!
//! A guest that breaks out of QEMU's device emulation can open whatever the VMM can. Running
//! as a uid of its own keeps it from other VMs' files, but not from everything any user may
//! read: `/etc`, `/home`, `/tmp`, `/proc` (every host process's command line), the
//! gateway's configuration and the snapshot directory. Firecracker's jailer answers this
//! with a chroot; this is the same answer built with a mount namespace. Between fork and
//! exec, before the VMM drops to its own uid, the child makes its mounts private, mounts a
//! small tmpfs, binds into it, each at its host path:
//!
//! - `/usr` and the merged-usr links (QEMU, its libraries, its firmware under
//!   `/usr/share/qemu`) and the dynamic linker's cache: read-only, no set-uid, no devices;
//! - the VMM's and the device backend's binaries and the guest images, each file on its
//!   own (the snapshots beside the images stay out of sight): read-only;
//! - `/dev/null`, `zero`, `random`, `urandom` (and `/dev/kvm` under KVM);
//! - the VM's runtime directory (its sockets, disk and console): writable, nothing
//!   executable;
//!
//! then `pivot_root`s into it, detaches the host's tree and makes the new root read-only.
//! No `/proc`, `/sys`, `/etc` (but the linker's cache), `/home`, host `/tmp`, gateway file,
//! other VM's directory, nor any host unix socket but the VM's own.
//!
//! Everything the child does is planned here, in the gateway, because the child of a
//! multi-threaded process may not allocate: every path is a ready C string, and the
//! descriptors of the sources live in an array on the child's stack. The child opens the
//! sources (`O_PATH`) in its new namespace before the tmpfs goes over `/tmp`, where a
//! runtime directory may be, and binds them through `/proc/self/fd/N` (a descriptor
//! opened in the gateway's namespace could not be bound in the child's). Written for
//! `pre_exec` rather than borrowed from the namespaces backend's `mounts.rs`, which runs
//! in a helper process of its own and may allocate.

#![allow(unsafe_code)]

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::sandbox::rootfs::USR_LINKS;
use crate::sandbox::sys::{
    check, check_long, mount, mount_setattr, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
};

/// Where the new root is put together: the child's own mount namespace mounts a tmpfs over
/// it, so the host's directory is neither touched nor hidden from anyone else.
const STAGING: &str = "/tmp";
/// The new root's tmpfs: mount points only.
const ROOT_OPTIONS: &CStr = c"mode=0755,size=1m,nr_inodes=1024";
/// The most host paths one VMM's root binds (the child keeps their descriptors in an
/// array of this size): the system's dozen, the binaries, the images and the VM's directory.
const MAX_SOURCES: usize = 32;
/// Host device nodes every VMM may open.
const DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"];

const READ_ONLY: u64 = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
const DEVICE: u64 = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC;
const WRITABLE: u64 = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;

/// Errors of planning a VMM's root.
#[derive(Debug, thiserror::Error)]
pub enum HostViewError {
    #[error("{path}: {source}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{0}: not an absolute path")]
    Relative(String),
    #[error("{0}: a path with a NUL byte")]
    Nul(String),
    #[error("more than {MAX_SOURCES} host paths for one VMM")]
    TooMany,
    #[error("the VMM's own root needs Linux 5.12 or later (mount_setattr, close_range); this host runs {0}")]
    OldKernel(String),
}

/// What every VMM of a backend sees, opened once.
pub(super) struct HostView {
    entries: Vec<Entry>,
}

enum Entry {
    /// A host file or directory at its own path, with these mount attributes.
    Bind {
        path: PathBuf,
        is_dir: bool,
        attrs: u64,
    },
    /// A symlink at `path`, as the host has it (the merged-usr links).
    Symlink { path: PathBuf, points_to: PathBuf },
}

impl HostView {
    /// The system part (`/usr`, its links, the linker's cache, the devices, `/dev/kvm` when
    /// `kvm`) and `files` (binaries and images, absolute paths; symlinks are resolved, so
    /// the file itself is shown, at its real path).
    pub(super) fn new(files: &[&Path], kvm: bool) -> Result<HostView, HostViewError> {
        // Said here, once, in words: in the child a missing system call is only an errno.
        let release = rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned();
        if !at_least(&release, (5, 12)) {
            return Err(HostViewError::OldKernel(release));
        }
        let mut entries = vec![bind(Path::new("/usr"), READ_ONLY)?];
        for name in USR_LINKS {
            let path = Path::new("/").join(name);
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.file_type().is_symlink() => entries.push(Entry::Symlink {
                    points_to: std::fs::read_link(&path).map_err(open_error(&path))?,
                    path,
                }),
                Ok(_) => entries.push(bind(&path, READ_ONLY)?),
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(open_error(&path)(error)),
            }
        }
        let ld_cache = Path::new("/etc/ld.so.cache");
        if ld_cache.exists() {
            entries.push(bind(ld_cache, READ_ONLY)?);
        }
        let kvm_device = kvm.then_some("/dev/kvm");
        for device in DEVICES.iter().copied().chain(kvm_device) {
            entries.push(bind(Path::new(device), DEVICE)?);
        }
        for file in files {
            if !file.is_absolute() {
                return Err(HostViewError::Relative(file.display().to_string()));
            }
            let real = std::fs::canonicalize(file).map_err(open_error(file))?;
            entries.push(bind(&real, READ_ONLY)?);
        }
        Ok(HostView { entries })
    }

    /// The plan of one VM's root: this view plus its runtime directory `dir` (absolute),
    /// writable, which is also where the VMM starts.
    pub(super) fn plan(&self, dir: &Path) -> Result<RootPlan, HostViewError> {
        if !dir.is_absolute() {
            return Err(HostViewError::Relative(dir.display().to_string()));
        }
        let dir = &std::fs::canonicalize(dir).map_err(open_error(dir))?;
        let own = bind(dir, WRITABLE)?;
        let mut entries: Vec<&Entry> = self.entries.iter().chain([&own]).collect();
        // Shallower first, so a mount never hides a deeper one.
        entries.sort_by_key(|entry| entry.path().components().count());
        let mut steps = Vec::new();
        let mut sources = Vec::new();
        let mut made: HashSet<PathBuf> = HashSet::new();
        let mut bound_dirs: Vec<&Path> = Vec::new();
        let staged = |path: &Path| cstring(&Path::new(STAGING).join(relative(path)));
        for entry in entries {
            let path = entry.path();
            // Under a directory bound already: the path is the host's there. A read-only
            // entry is then visible as it is; a writable one is bound over it, and nothing
            // is made (that would make it on the host).
            let covered = bound_dirs.iter().any(|dir| path.starts_with(dir));
            if !covered {
                for ancestor in path
                    .ancestors()
                    .skip(1)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                {
                    if ancestor.parent().is_some() && made.insert(ancestor.to_owned()) {
                        steps.push(Step::Mkdir(staged(ancestor)?));
                    }
                }
            }
            match entry {
                Entry::Symlink { path, points_to } if !covered => {
                    steps.push(Step::Symlink {
                        at: staged(path)?,
                        points_to: cstring(points_to)?,
                    });
                }
                Entry::Symlink { .. } => {}
                Entry::Bind { attrs, .. } if covered && *attrs != WRITABLE => {}
                Entry::Bind {
                    path,
                    is_dir,
                    attrs,
                } => {
                    if !covered {
                        made.insert(path.to_owned());
                        steps.push(if *is_dir {
                            Step::Mkdir(staged(path)?)
                        } else {
                            Step::Touch(staged(path)?)
                        });
                    }
                    if *is_dir {
                        bound_dirs.push(path);
                    }
                    if sources.len() == MAX_SOURCES {
                        return Err(HostViewError::TooMany);
                    }
                    steps.push(Step::Bind {
                        source: sources.len(),
                        target: staged(path)?,
                        attrs: *attrs,
                    });
                    sources.push(cstring(path)?);
                }
            }
        }
        Ok(RootPlan {
            sources,
            steps,
            workdir: cstring(dir)?,
        })
    }
}

impl Entry {
    fn path(&self) -> &Path {
        match self {
            Entry::Bind { path, .. } | Entry::Symlink { path, .. } => path,
        }
    }
}

/// One VM's root, ready for the child to build.
pub(super) struct RootPlan {
    /// The host paths bound, by index.
    sources: Vec<CString>,
    steps: Vec<Step>,
    /// Where the VMM works: its runtime directory, at its host path.
    workdir: CString,
}

enum Step {
    Mkdir(CString),
    /// An empty file to bind a file over.
    Touch(CString),
    Symlink {
        at: CString,
        points_to: CString,
    },
    Bind {
        /// Index into the plan's sources.
        source: usize,
        target: CString,
        attrs: u64,
    },
}

impl RootPlan {
    /// Builds the root and moves into it. Runs in the forked child, inside a fresh mount
    /// namespace, with the capability to mount; makes system calls only.
    pub(super) fn enter(&self) -> io::Result<()> {
        let staging = c"/tmp";
        debug_assert_eq!(staging.to_bytes(), STAGING.as_bytes());
        // Nothing of what follows may propagate back to the host's mounts.
        mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
        let mut fds = [-1; MAX_SOURCES];
        for (fd, source) in fds.iter_mut().zip(&self.sources) {
            // SAFETY: a NUL-terminated path. O_NOFOLLOW: the gateway resolved every path;
            // a symlink put in its place since is bound as a link, never followed.
            *fd = unsafe {
                libc::open(
                    source.as_ptr(),
                    libc::O_PATH | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                )
            };
            check(*fd)?;
        }
        mount(
            Some(c"tmpfs"),
            staging,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some(ROOT_OPTIONS),
        )?;
        for step in &self.steps {
            match step {
                Step::Mkdir(path) => {
                    // SAFETY: a NUL-terminated path.
                    if unsafe { libc::mkdir(path.as_ptr(), 0o755) } != 0 {
                        let error = io::Error::last_os_error();
                        if error.raw_os_error() != Some(libc::EEXIST) {
                            return Err(error);
                        }
                    }
                }
                Step::Touch(path) => {
                    // SAFETY: a NUL-terminated path; the descriptor is closed at once.
                    let fd = unsafe {
                        libc::open(
                            path.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o644,
                        )
                    };
                    check(fd)?;
                    // SAFETY: closing the descriptor just opened.
                    unsafe { libc::close(fd) };
                }
                Step::Symlink { at, points_to } => {
                    // SAFETY: two NUL-terminated paths.
                    check(unsafe { libc::symlink(points_to.as_ptr(), at.as_ptr()) })?;
                }
                Step::Bind {
                    source,
                    target,
                    attrs,
                } => {
                    let mut buffer = [0u8; 32];
                    let source = fd_path(fds[*source], &mut buffer)?;
                    mount(
                        Some(source),
                        target,
                        None,
                        libc::MS_BIND | libc::MS_REC,
                        None,
                    )?;
                    mount_setattr(target, *attrs, true)?;
                }
            }
        }
        // SAFETY: NUL-terminated paths; pivot_root(".", ".") stacks the old root on the
        // new one, and detaching "." then drops the whole host tree from this namespace.
        unsafe {
            check(libc::chdir(staging.as_ptr()))?;
            check_long(libc::syscall(
                libc::SYS_pivot_root,
                c".".as_ptr(),
                c".".as_ptr(),
            ))?;
            check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            check(libc::chdir(c"/".as_ptr()))?;
        }
        mount_setattr(c"/", READ_ONLY, false)?;
        // SAFETY: a NUL-terminated path.
        check(unsafe { libc::chdir(self.workdir.as_ptr()) }).map(drop)
    }
}

/// Whether a kernel release (`6.1.0-18-amd64`) is at least `(major, minor)`.
fn at_least(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|part| part.parse::<u32>().ok());
    let found = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    found >= (major, minor)
}

fn bind(path: &Path, attrs: u64) -> Result<Entry, HostViewError> {
    let meta = std::fs::metadata(path).map_err(open_error(path))?;
    Ok(Entry::Bind {
        path: path.to_owned(),
        is_dir: meta.is_dir(),
        attrs,
    })
}

/// `/proc/self/fd/<fd>` in `buffer`, NUL-terminated, without allocating.
fn fd_path(fd: libc::c_int, buffer: &mut [u8; 32]) -> io::Result<&CStr> {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buffer[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let mut count = 0;
    let mut rest = fd.unsigned_abs();
    loop {
        digits[count] = b'0' + (rest % 10) as u8;
        count += 1;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    for (i, digit) in digits[..count].iter().rev().enumerate() {
        buffer[PREFIX.len() + i] = *digit;
    }
    buffer[PREFIX.len() + count] = 0;
    // 14 + 10 + 1 bytes always fit, so the NUL is there; an error does not allocate.
    CStr::from_bytes_until_nul(&buffer[..]).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn open_error(path: &Path) -> impl FnOnce(io::Error) -> HostViewError + '_ {
    move |source| HostViewError::Open {
        path: path.display().to_string(),
        source,
    }
}

fn relative(path: &Path) -> &Path {
    path.strip_prefix("/").unwrap_or(path)
}

fn cstring(path: &Path) -> Result<CString, HostViewError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| HostViewError::Nul(path.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(plan: &RootPlan) -> Vec<String> {
        plan.steps
            .iter()
            .map(|step| match step {
                Step::Mkdir(p) => format!("mkdir {}", p.to_string_lossy()),
                Step::Touch(p) => format!("touch {}", p.to_string_lossy()),
                Step::Symlink { at, points_to } => format!(
                    "link {} -> {}",
                    at.to_string_lossy(),
                    points_to.to_string_lossy()
                ),
                Step::Bind { target, attrs, .. } => {
                    format!("bind {} {attrs:x}", target.to_string_lossy())
                }
            })
            .collect()
    }

    #[test]
    fn the_plan_binds_only_what_it_was_given_and_the_runtime_dir_writable() {
        let scratch = tempfile::tempdir().unwrap();
        let images = scratch.path().join("guest");
        std::fs::create_dir(&images).unwrap();
        let image = images.join("vmlinux");
        std::fs::write(&image, b"kernel").unwrap();
        std::fs::write(images.join("secret.vmstate"), b"not for the VMM").unwrap();
        let run = scratch.path().join("run/k1");
        std::fs::create_dir_all(&run).unwrap();

        let view = HostView::new(&[&image, Path::new("/usr/bin/env")], false).unwrap();
        let plan = view.plan(&run).unwrap();
        let steps = names(&plan);
        let real = std::fs::canonicalize(scratch.path()).unwrap();
        let staged = |p: &Path| format!("/tmp/{}", relative(p).display());
        let image_bind = format!("bind {} {READ_ONLY:x}", staged(&real.join("guest/vmlinux")));
        let run_bind = format!("bind {} {WRITABLE:x}", staged(&real.join("run/k1")));
        assert!(steps.contains(&image_bind), "{steps:#?}");
        assert!(steps.contains(&run_bind), "{steps:#?}");
        assert!(
            steps.contains(&format!("bind /tmp/usr {READ_ONLY:x}")),
            "{steps:#?}"
        );
        assert!(
            steps.contains(&format!("bind /tmp/dev/null {DEVICE:x}")),
            "{steps:#?}"
        );
        // The images' directory is made, not bound: nothing else in it is shown.
        assert!(!steps.iter().any(|s| s.contains("secret")), "{steps:#?}");
        assert!(
            !steps.contains(&format!(
                "bind {} {READ_ONLY:x}",
                staged(&real.join("guest"))
            )),
            "{steps:#?}"
        );
        // /usr/bin/env is under /usr, already bound: no second bind, nothing made there.
        assert!(
            !steps.iter().any(|s| s.contains("/tmp/usr/bin")),
            "{steps:#?}"
        );
        // A mount point is made before it is bound.
        let made = steps
            .iter()
            .position(|s| s == &format!("touch {}", staged(&real.join("guest/vmlinux"))))
            .expect("the image's mount point");
        let bound = steps.iter().position(|s| s == &image_bind).unwrap();
        assert!(made < bound, "{steps:#?}");
        assert_eq!(
            plan.workdir.to_bytes(),
            real.join("run/k1").as_os_str().as_bytes()
        );
    }

    #[test]
    fn descriptor_paths_are_written_without_allocating() {
        let mut buffer = [0u8; 32];
        assert_eq!(fd_path(0, &mut buffer).unwrap(), c"/proc/self/fd/0");
        assert_eq!(
            fd_path(1234567890, &mut buffer).unwrap(),
            c"/proc/self/fd/1234567890"
        );
        assert_eq!(fd_path(17, &mut buffer).unwrap(), c"/proc/self/fd/17");
    }

    #[test]
    fn kernel_releases_compare_by_number() {
        assert!(at_least("6.1.0-18-amd64", (5, 12)));
        assert!(at_least("5.12.0", (5, 12)));
        assert!(!at_least("5.10.209", (5, 12)));
        assert!(at_least("6.18.44-fc-v669", (5, 12)));
        assert!(!at_least("", (5, 12)));
    }

    #[test]
    fn relative_paths_are_refused() {
        assert!(matches!(
            HostView::new(&[Path::new("target/guest/vmlinux")], false),
            Err(HostViewError::Relative(_))
        ));
        let view = HostView::new(&[], false).unwrap();
        assert!(matches!(
            view.plan(Path::new("run/k1")),
            Err(HostViewError::Relative(_))
        ));
    }
}
