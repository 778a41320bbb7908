//! The guest's files on the host: the kernel, the initramfs with the agent and the shared
//! root image, which `./dev setup` builds (`guest/build-kernel.sh`, `guest/build-image.py`)
//! and names in `guest.json`; and each VM's private workspace disk.

use std::path::{Path, PathBuf};

use super::{io_error, MicrovmError};

/// The manifest `./dev setup` writes beside the images.
pub const MANIFEST: &str = "guest.json";

/// The guest images one backend boots every VM from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestImages {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub root: PathBuf,
    /// The kernel is a PVM guest (an operator's, e.g. for hosts whose KVM is PVM-only).
    pub pvm_guest: bool,
    /// The kernelspecs whose environments the root image holds (the agent shows a kernel
    /// its own); none in an image built before environments, which holds python3's alone.
    pub environments: Vec<String>,
}

#[derive(serde::Deserialize)]
struct Manifest {
    kernel: PathBuf,
    initramfs: PathBuf,
    root: PathBuf,
    #[serde(default)]
    pvm_guest: bool,
    #[serde(default)]
    environments: Vec<String>,
}

/// Where the images are by default: `CELLGATE_GUEST_DIR`, else `guest/` beside the
/// directory of the gateway's binary (`target/guest` for `target/release/cellgate`).
pub fn default_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CELLGATE_GUEST_DIR") {
        return PathBuf::from(dir);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("guest")))
        .unwrap_or_else(|| PathBuf::from("target/guest"))
}

/// The environments the root image in `dir` holds, as its manifest lists them; none when
/// it lists none (an image built before environments) or cannot be read (the backend then
/// says why when it starts).
pub fn environments(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join(MANIFEST))
        .ok()
        .and_then(|text| serde_json::from_str::<Manifest>(&text).ok())
        .map(|manifest| manifest.environments)
        .unwrap_or_default()
}

impl GuestImages {
    /// Reads `dir/guest.json` and checks that the files it names exist. An operator's own
    /// guest kernel (`own_kernel`: its path, and whether it is a PVM guest) replaces the
    /// project's.
    pub fn locate(
        dir: &Path,
        own_kernel: Option<(&Path, bool)>,
    ) -> Result<GuestImages, MicrovmError> {
        let manifest_path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&manifest_path).map_err(|e| {
            MicrovmError::Image(format!(
                "{}: {e} (build the guest with ./dev setup, or point CELLGATE_GUEST_DIR at it)",
                manifest_path.display()
            ))
        })?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| MicrovmError::Image(format!("{}: {e}", manifest_path.display())))?;
        let relative = |path: PathBuf| {
            if path.is_absolute() {
                path
            } else {
                dir.join(path)
            }
        };
        let mut images = GuestImages {
            kernel: relative(manifest.kernel),
            initramfs: relative(manifest.initramfs),
            root: relative(manifest.root),
            pvm_guest: manifest.pvm_guest,
            environments: manifest.environments,
        };
        if let Some((kernel, pvm)) = own_kernel {
            images.kernel = kernel.to_owned();
            images.pvm_guest = pvm;
        }
        for path in [&images.kernel, &images.initramfs, &images.root] {
            if !path.is_file() {
                return Err(MicrovmError::Image(format!(
                    "{} does not exist (rebuild the guest with ./dev setup)",
                    path.display()
                )));
            }
        }
        // Absolute, without symlinks: a VMM sees these files, at these paths, in a root
        // of its own (see `hostview`), and its working directory is elsewhere.
        for path in [&mut images.kernel, &mut images.initramfs, &mut images.root] {
            *path = std::fs::canonicalize(&*path)
                .map_err(|e| MicrovmError::Image(format!("{}: {e}", path.display())))?;
        }
        Ok(images)
    }
}

/// Makes a VM's workspace disk: a sparse file of `bytes` holding an empty ext4 file system
/// whose root belongs to `uid`. Sparse, so it costs the host only what the kernel writes;
/// its size is the policy's workspace limit, which the guest cannot exceed. Returns the
/// disk's length.
pub async fn make_workspace_disk(path: &Path, bytes: u64, uid: u32) -> Result<u64, MicrovmError> {
    let file = std::fs::File::create(path).map_err(io_error(format!("{}", path.display())))?;
    // ext4 needs a little room for itself; below 8 MiB mke2fs refuses.
    let length = bytes.max(8 << 20);
    file.set_len(length)
        .map_err(io_error(format!("{}", path.display())))?;
    drop(file);
    let output = tokio::process::Command::new("mke2fs")
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-O",
            "^has_journal",
            "-m",
            "0",
            "-E",
        ])
        .arg(format!("root_owner={uid}:{uid}"))
        .arg(path)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .await
        .map_err(io_error("mke2fs (apt-get install e2fsprogs)"))?;
    if !output.status.success() {
        return Err(MicrovmError::Start(format!(
            "mke2fs {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(length)
}
